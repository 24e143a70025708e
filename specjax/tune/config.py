"""spec-tune configs: a bench config plus a strict, validated `tune:` section (the search space,
strategy, metric and budget), read from YAML with command-line overrides."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from specjax.bench.config import (ConfigError, ExperimentConfig, MethodConfig, _build, config_from_dict,
                                  to_dict)
from specjax.drafters import speculator_spec

METRICS = ("tokens_per_s", "mean_tokens_per_s", "speedup")
STRATEGIES = ("random", "halving")
DEFAULT_METHOD = MethodConfig(name="default", speculator="ngram_simple")


def head_speculators() -> tuple[str, ...]:
  """Registered speculators that need `head` choices (trained files)."""
  return tuple(n for n, s in speculator_spec.registered().items() if s.head_format)


def tree_speculators() -> tuple[str, ...]:
  """Registered tree speculators: they set their own budget (no adaptive lengths)."""
  return tuple(n for n, s in speculator_spec.registered().items() if s.tree)


def chainable_speculators() -> tuple[str, ...]:
  return tuple(n for n, s in speculator_spec.registered().items() if s.chainable)


class TuneError(RuntimeError):
  """The search could not produce a result (e.g. no trial finished within the budget)."""


@dataclasses.dataclass(frozen=True)
class BudgetConfig:
  trials: int | None = 16          # candidates tried, the default included
  seconds: float | None = None     # wall time of the search (plain reference + trials)


@dataclasses.dataclass(frozen=True)
class ChainSpace:
  members: tuple[str, ...] = ()    # host speculators that may be chained (no chains when empty)
  max_len: int = 2
  policies: tuple[str, ...] = ("best", "first")


@dataclasses.dataclass(frozen=True)
class TuneSettings:
  seed: int = 0
  strategy: str = "halving"                       # "random" | "halving"
  eta: int = 2                                    # halving: keep 1/eta per rung, eta x the questions
  min_questions: int = 1                          # halving: questions of the first rung (at least)
  metric: str = "tokens_per_s"                    # "tokens_per_s" | "mean_tokens_per_s" | "speedup"
  budget: BudgetConfig = BudgetConfig()
  holdout_fraction: float = 0.5                   # questions held out of the search, per category
  include_default: bool = True                    # trial 0 is the default method
  arm_weights: dict = dataclasses.field(default_factory=dict)   # speculator (or "chain") -> draw weight, default 1
  speculators: dict = dataclasses.field(default_factory=lambda: {
      "ngram_simple": {"size_n": [1, 2, 3, 4], "size_m": [8, 16, 32]}})
  chains: ChainSpace = ChainSpace()
  draft_params: dict = dataclasses.field(default_factory=lambda: {"n_max": [4, 8, 16], "n_min": [0]})


@dataclasses.dataclass(frozen=True)
class TuneConfig:
  experiment: ExperimentConfig                    # everything but `tune`: what every trial runs
  tune: TuneSettings

  @property
  def name(self) -> str:
    return self.experiment.name

  @property
  def default_method(self) -> MethodConfig:
    return self.experiment.methods[0] if self.experiment.methods else DEFAULT_METHOD


def _choices(value) -> list:
  return list(value) if isinstance(value, (list, tuple)) else [value]


def _option_names(name: str) -> set[str] | None:
  """The options a speculator takes (its registry schema)."""
  return set(speculator_spec.get(name).option_names)


def _check_draft_params_space(space: Any, where: str) -> None:
  if not isinstance(space, dict):
    raise ConfigError(f"{where}: expected a mapping of n_max / n_min / p_min to choices")
  bad = sorted(set(space) - {"n_max", "n_min", "p_min"})
  if bad:
    raise ConfigError(f"{where}: unknown key(s) {bad}; allowed: ['n_max', 'n_min', 'p_min']")
  for k, v in space.items():
    vals = _choices(v)
    if not vals:
      raise ConfigError(f"{where}.{k}: needs at least one choice")
    for x in vals:
      ok = isinstance(x, (int, float)) and not isinstance(x, bool)
      if k != "p_min":
        ok = ok and isinstance(x, int)
      if not ok:
        raise ConfigError(f"{where}.{k}: bad choice {x!r}")
    if k == "n_max" and min(vals) < 1:
      raise ConfigError(f"{where}.n_max: choices must be >= 1")
    if k == "n_min" and min(vals) < 0:
      raise ConfigError(f"{where}.n_min: choices must be >= 0")
    if k == "p_min" and not all(0 <= x <= 1 for x in vals):
      raise ConfigError(f"{where}.p_min: choices must be in [0, 1]")


def validate_tune(t: TuneSettings, where: str = "tune") -> TuneSettings:
  if t.strategy not in STRATEGIES:
    raise ConfigError(f"{where}.strategy: must be one of {list(STRATEGIES)}, got {t.strategy!r}")
  if t.metric not in METRICS:
    raise ConfigError(f"{where}.metric: must be one of {list(METRICS)}, got {t.metric!r}")
  if t.eta < 2:
    raise ConfigError(f"{where}.eta: must be >= 2")
  if t.min_questions < 1:
    raise ConfigError(f"{where}.min_questions: must be >= 1")
  b = t.budget
  if b.trials is None and b.seconds is None:
    raise ConfigError(f"{where}.budget: give trials, seconds or both")
  if b.trials is not None and b.trials < 1:
    raise ConfigError(f"{where}.budget.trials: must be >= 1")
  if b.seconds is not None and b.seconds <= 0:
    raise ConfigError(f"{where}.budget.seconds: must be > 0")
  if t.strategy == "halving" and b.trials is None:
    raise ConfigError(f"{where}.budget.trials: successive halving needs a number of trials "
                      "(use strategy: random for a budget in seconds only)")
  if not 0 < t.holdout_fraction < 1:
    raise ConfigError(f"{where}.holdout_fraction: must be in (0, 1)")
  if not t.speculators and not t.chains.members:
    raise ConfigError(f"{where}.speculators: the search space is empty")
  for name, space in t.speculators.items():
    sub = f"{where}.speculators.{name}"
    if name not in speculator_spec.names():
      raise ConfigError(f"{sub}: unknown speculator; known: {list(speculator_spec.names())}")
    if space is None:
      continue
    if not isinstance(space, dict):
      raise ConfigError(f"{sub}: expected a mapping of option -> choices")
    allowed = _option_names(name)
    for opt, vals in space.items():
      if opt == "draft_params":
        _check_draft_params_space(vals, f"{sub}.draft_params")
      elif opt == "draft_model":
        if name != "draft":
          raise ConfigError(f"{sub}.draft_model: only for speculator 'draft'")
      elif opt == "head":
        if name not in head_speculators():
          raise ConfigError(f"{sub}.head: only for speculators {list(head_speculators())}")
      elif opt == "adaptive":
        if name in tree_speculators() or any(not isinstance(v, bool) for v in _choices(vals)):
          raise ConfigError(f"{sub}.adaptive: true / false choices, for chain (non-tree) speculators")
      elif allowed is not None and opt not in allowed:
        raise ConfigError(f"{sub}: unknown option {opt!r}; allowed: {sorted(allowed)} and draft_params")
      if opt != "draft_params" and not _choices(vals):
        raise ConfigError(f"{sub}.{opt}: needs at least one choice")
  if "draft" in t.speculators and not (t.speculators["draft"] or {}).get("draft_model"):
    raise ConfigError(f"{where}.speculators.draft: needs draft_model choices")
  for name in head_speculators():
    if name in t.speculators and not (t.speculators[name] or {}).get("head"):
      raise ConfigError(f"{where}.speculators.{name}: needs head choices")
  arms = set(t.speculators) | ({"chain"} if t.chains.members else set())
  for a, w in t.arm_weights.items():
    if a not in arms:
      raise ConfigError(f"{where}.arm_weights.{a}: not in the space (speculators, or 'chain' with chain members)")
    if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
      raise ConfigError(f"{where}.arm_weights.{a}: must be a number >= 0")
  if t.arm_weights and not any(float(t.arm_weights.get(a, 1.0)) > 0 for a in arms):
    raise ConfigError(f"{where}.arm_weights: every weight is 0")
  c = t.chains
  bad = [m for m in c.members if m not in chainable_speculators()]
  if bad:
    raise ConfigError(f"{where}.chains.members: only host speculators chain ({list(chainable_speculators())}), "
                      f"got {bad}")
  if c.members and not 2 <= c.max_len <= len(c.members):
    raise ConfigError(f"{where}.chains.max_len: must be in [2, {len(c.members)}] (the number of members)")
  if c.members and (not c.policies or any(p not in ("best", "first") for p in c.policies)):
    raise ConfigError(f"{where}.chains.policies: choose from ['best', 'first']")
  _check_draft_params_space(t.draft_params, f"{where}.draft_params")
  if "n_max" not in t.draft_params:
    raise ConfigError(f"{where}.draft_params.n_max: needs choices")
  return t


def tune_config_from_dict(data: dict, where: str = "config") -> TuneConfig:
  if not isinstance(data, dict):
    raise ConfigError(f"{where}: expected a mapping")
  if "tune" not in data:
    raise ConfigError(f"{where}: missing the 'tune' section")
  data = dict(data)
  tune = _build(TuneSettings, data.pop("tune") or {}, f"{where}.tune")
  return TuneConfig(experiment=config_from_dict(data, where), tune=validate_tune(tune, f"{where}.tune"))


_TUNE_OVERRIDES = ("seed", "strategy", "metric")


def load_tune_config(path: str | Path, **overrides) -> TuneConfig:
  """Read a tune config; overrides (None = keep): experiment keys (limit, dtype, max_new_tokens, ...),
  seed / strategy / metric, and trials / seconds (the budget)."""
  from specjax.io.yaml_config import load_config as load_yaml_config
  path = Path(path)
  data = load_yaml_config(path)                 # `base:` chains merged in
  if not isinstance(data, dict):
    raise ConfigError(f"{path}: expected a mapping")
  if "tune" not in data:
    raise ConfigError(f"{path.name}: missing the 'tune' section (a tune config is a bench config plus `tune:`)")
  data = {**data, "tune": dict(data["tune"] or {})}
  ov = {k: v for k, v in overrides.items() if v is not None}
  for k in _TUNE_OVERRIDES:
    if k in ov:
      data["tune"][k] = ov.pop(k)
  if "trials" in ov or "seconds" in ov:
    budget = dict(data["tune"].get("budget") or {})
    if "trials" in ov:
      budget["trials"] = ov.pop("trials")
    if "seconds" in ov:
      budget["seconds"] = ov.pop("seconds")
    data["tune"]["budget"] = budget
  data.update(ov)
  return tune_config_from_dict(data, where=path.name)


def tune_config_to_dict(tcfg: TuneConfig) -> dict:
  return {**_plain(to_dict(tcfg.experiment)), "tune": _plain(dataclasses.asdict(tcfg.tune))}


def _plain(x):
  """Tuples -> lists, numpy scalars -> Python (YAML- and JSON-safe)."""
  if isinstance(x, dict):
    return {k: _plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  if isinstance(x, np.generic):
    return x.item()
  return x
