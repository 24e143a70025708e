"""Experiment configs: dataclasses filled from YAML, strictly (unknown keys and bad values are
errors that name the key)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
  """A config file is malformed; the message names the offending key."""


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0


@dataclasses.dataclass(frozen=True)
class DraftParamsConfig:
  n_max: int = 8
  n_min: int = 0
  p_min: float = 0.0


@dataclasses.dataclass(frozen=True)
class MethodConfig:
  name: str
  speculator: str                                   # "draft", "ngram_simple", ..., or a chain "a,b"
  draft_model: str | None = None
  head: str | None = None                           # trained head file for "mtp" (and later eagle3 / dflash)
  policy: str = "best"                              # chains: "best" | "first"
  options: dict = dataclasses.field(default_factory=dict)
  draft_params: DraftParamsConfig = DraftParamsConfig()
  adaptive: bool | dict = False                     # adaptive drafting (true, or AdaptiveConfig fields)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  name: str
  target: str = "smollm2-135m-instruct"
  dtype: str = "float32"
  prompts: tuple[str, ...] = ("mt_bench",)        # prompt-set names or paths
  limit: int | None = None                          # questions per prompt set
  categories: tuple[str, ...] = ()
  turns: int = 2                                    # multi-turn questions: how many turns to run
  max_new_tokens: int = 256
  batch_size: int = 1
  repeats: int = 1
  interleave: bool = False                          # run every method on a batch before the next batch (the
                                                    # methods share the machine's drift over the run)
  seed: int = 0
  capacity: int | None = None
  chat: bool = True
  sampling: SamplingConfig = SamplingConfig()
  methods: tuple[MethodConfig, ...] = ()


def _type_ok(value, tp) -> bool:
  origin = typing.get_origin(tp)
  if tp is Any:
    return True
  if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
    return any(_type_ok(value, a) for a in typing.get_args(tp))
  if tp is type(None):
    return value is None
  if tp is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if tp is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if origin in (tuple, list):
    return isinstance(value, (list, tuple))
  if origin is dict or tp is dict:
    return isinstance(value, dict)
  if isinstance(tp, type):
    return isinstance(value, tp)
  return True


def _build(cls, data: Any, where: str):
  if not isinstance(data, dict):
    raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
  hints = typing.get_type_hints(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - set(fields))
  if unknown:
    raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
  kwargs = {}
  for key, value in data.items():
    tp = hints[key]
    sub = f"{where}.{key}"
    if dataclasses.is_dataclass(tp):
      kwargs[key] = _build(tp, value, sub)
    elif typing.get_origin(tp) is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]):
      if not isinstance(value, list):
        raise ConfigError(f"{sub}: expected a list")
      kwargs[key] = tuple(_build(typing.get_args(tp)[0], v, f"{sub}[{i}]") for i, v in enumerate(value))
    else:
      if not _type_ok(value, tp):
        raise ConfigError(f"{sub}: bad value {value!r} (expected {tp})")
      kwargs[key] = tuple(value) if typing.get_origin(tp) is tuple else value
  missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
             and f.default_factory is dataclasses.MISSING]
  if missing:
    raise ConfigError(f"{where}: missing required key(s) {missing}")
  return cls(**kwargs)


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
  from specjax.drafters.registry import check_speculator
  from specjax.drafters.speculator_spec import names as known
  from specjax.errors import UserError
  for i, m in enumerate(cfg.methods):
    names = [s.strip() for s in m.speculator.split(",")]
    bad = [n for n in names if n not in known()]
    if bad:
      raise ConfigError(f"methods[{i}].speculator: unknown speculator(s) {bad}; known: {list(known())}")
    # options against the speculators' schemas, chains, the kind of an existing head file: before any
    # model is loaded (a head a training stage will write is checked when the method is built)
    head = m.head if m.head and Path(m.head).exists() else None
    try:
      check_speculator(m.speculator, m.options, head=head, draft_model=m.draft_model)
    except UserError as e:
      raise ConfigError(f"methods[{i}] ({m.name}): {e}") from None
    if m.policy not in ("best", "first"):
      raise ConfigError(f"methods[{i}].policy: must be 'best' or 'first', got {m.policy!r}")
    if "draft" in names and not m.draft_model:
      raise ConfigError(f"methods[{i}].draft_model: required for speculator 'draft'")
    if m.draft_params.n_max < 1 or m.draft_params.n_min < 0 or m.draft_params.n_min > m.draft_params.n_max:
      raise ConfigError(f"methods[{i}].draft_params: need 1 <= n_max and 0 <= n_min <= n_max")
  if cfg.max_new_tokens < 1 or cfg.batch_size < 1 or cfg.repeats < 1 or cfg.turns < 1:
    raise ConfigError("max_new_tokens, batch_size, repeats and turns must be >= 1")
  if cfg.sampling.temperature < 0 or not (0 < cfg.sampling.top_p <= 1):
    raise ConfigError("sampling.temperature must be >= 0 and sampling.top_p in (0, 1]")
  if cfg.dtype not in ("float32", "bfloat16", "float16"):
    raise ConfigError(f"dtype: must be float32, bfloat16 or float16, got {cfg.dtype!r}")
  return cfg


def config_from_dict(data: dict, where: str = "config") -> ExperimentConfig:
  return validate(_build(ExperimentConfig, data, where))


def load_config(path: str | Path, **overrides) -> ExperimentConfig:
  path = Path(path)
  try:
    data = yaml.safe_load(path.read_text())
  except yaml.YAMLError as e:
    raise ConfigError(f"{path}: not valid YAML: {e}") from e
  if data is None:
    raise ConfigError(f"{path}: empty config")
  if isinstance(data, dict):
    data = {**data, **{k: v for k, v in overrides.items() if v is not None}}
  return config_from_dict(data, where=path.name)


def to_dict(cfg) -> dict:
  return dataclasses.asdict(cfg)
