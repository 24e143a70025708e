"""The search space: candidate methods drawn from `TuneSettings` deterministically given the seed,
their readable labels and identity keys."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from specjax.bench.config import DraftParamsConfig, MethodConfig, to_dict
from specjax.drafters.registry import MODEL_SPECULATORS
from specjax.tune.config import TuneSettings, _choices, _plain

SPACE_KEYS = ("draft_params", "draft_model", "head", "adaptive")   # keys of a speculator's space that are not options


def method_label(m: MethodConfig) -> str:
  """A short, readable description: `ngram_simple(size_n=3,size_m=16) n_max=8`."""
  def opts(d):
    return ",".join(f"{k}={v}" for k, v in sorted(d.items()))
  names = [s.strip() for s in m.speculator.split(",")]
  if len(names) > 1:
    parts = [f"{n}({opts(m.options.get(n, {}))})" if m.options.get(n) else n for n in names]
    spec = f"chain_{m.policy}[{', '.join(parts)}]"
  else:
    spec = f"{names[0]}({opts(m.options)})" if m.options else names[0]
  dp = m.draft_params
  s = f"{spec} n_max={dp.n_max}"
  if dp.n_min:
    s += f" n_min={dp.n_min}"
  if dp.p_min:
    s += f" p_min={dp.p_min:g}"
  if m.draft_model:
    s += f" draft={m.draft_model}"
  if m.adaptive:
    s += " adaptive"
  return s


def method_key(m: MethodConfig) -> str:
  d = to_dict(m)
  d.pop("name")
  return json.dumps(_plain(d), sort_keys=True)


def _max_draft(m: MethodConfig) -> int | None:
  """The longest draft of a host speculator configuration (None for model drafters)."""
  names = [s.strip() for s in m.speculator.split(",")]
  if any(n in MODEL_SPECULATORS for n in names):
    return None
  from specjax.drafters.registry import make_speculator
  return int(make_speculator(m.speculator, None, draft_params=None, options=dict(m.options),
                             policy=m.policy).max_draft)


class Space:
  """Draws candidate methods from `TuneSettings`, deterministically given the seed."""

  def __init__(self, t: TuneSettings):
    self.t = t
    self.arms = list(t.speculators) + (["chain"] if t.chains.members else [])
    w = np.asarray([float(t.arm_weights.get(a, 1.0)) for a in self.arms])
    self.p = None if not t.arm_weights else w / w.sum()
    self.rng = np.random.default_rng(t.seed)
    self._max_draft_cache: dict[str, int | None] = {}

  def _pick(self, values):
    vals = _choices(values)
    v = vals[int(self.rng.integers(len(vals)))]
    return v.item() if isinstance(v, np.generic) else v

  def _options(self, name: str) -> tuple[dict, dict]:
    """(constructor options, extra: draft_model / head / draft_params space)."""
    space = self.t.speculators.get(name) or {}
    opts = {k: self._pick(v) for k, v in space.items() if k not in SPACE_KEYS}
    extra = {k: space[k] for k in SPACE_KEYS if k in space}
    return opts, extra

  def _draft_params(self, space: dict, model: bool) -> DraftParamsConfig:
    space = {**self.t.draft_params, **space}
    n_max = int(self._pick(space["n_max"]))
    n_min = int(self._pick(space.get("n_min", [0])))
    p_min = float(self._pick(space.get("p_min", [0.0]))) if model else 0.0   # p_min only stops model drafters
    return DraftParamsConfig(n_max=n_max, n_min=n_min, p_min=p_min)

  def draw(self, name: str) -> MethodConfig:
    i = int(self.rng.integers(len(self.arms))) if self.p is None else int(self.rng.choice(len(self.arms), p=self.p))
    arm = self.arms[i]
    if arm == "chain":
      c = self.t.chains
      n = int(self.rng.integers(2, c.max_len + 1))
      members = [c.members[i] for i in self.rng.permutation(len(c.members))[:n]]
      policy = self._pick(c.policies)
      options, dp_space = {}, {}
      for mem in members:
        opts, extra = self._options(mem)
        opts.pop("device", None)                 # chain members always run on the host
        if opts:
          options[mem] = opts
        dp_space.update(extra.get("draft_params", {}))
      method = MethodConfig(name=name, speculator=",".join(members), policy=policy, options=options,
                            draft_params=self._draft_params(dp_space, model=False))
    else:
      opts, extra = self._options(arm)
      model = arm in MODEL_SPECULATORS
      method = MethodConfig(name=name, speculator=arm, options=opts,
                            draft_model=self._pick(extra["draft_model"]) if "draft_model" in extra else None,
                            head=self._pick(extra["head"]) if "head" in extra else None,
                            adaptive=bool(self._pick(extra["adaptive"])) if "adaptive" in extra else False,
                            draft_params=self._draft_params(extra.get("draft_params", {}), model=model))
    return self._capped(method)

  def _capped(self, m: MethodConfig) -> MethodConfig:
    key = method_key(dataclasses.replace(m, draft_params=DraftParamsConfig()))
    if key not in self._max_draft_cache:
      try:
        self._max_draft_cache[key] = _max_draft(m)
      except (TypeError, ValueError):            # a bad option combination: the trial will report it
        self._max_draft_cache[key] = None
    k = self._max_draft_cache[key]
    dp = m.draft_params
    n_max = dp.n_max if k is None else max(1, min(dp.n_max, k))
    return dataclasses.replace(m, draft_params=DraftParamsConfig(n_max=n_max, n_min=min(dp.n_min, n_max),
                                                                 p_min=dp.p_min))

  def candidates(self, n: int | None, seen: set[str] | None = None, max_tries: int = 200):
    """Yield up to n (None: without end) distinct methods named trial1, trial2, ... not in `seen`."""
    seen = set() if seen is None else seen
    i = 0
    while n is None or i < n:
      for _ in range(max_tries):
        m = self.draw(f"trial{len(seen)}")
        k = method_key(m)
        if k not in seen:
          break
      else:
        return                                   # the space looks exhausted
      seen.add(k)
      i += 1
      yield m


def sample_candidates(t: TuneSettings, n: int, default: MethodConfig | None = None) -> list[MethodConfig]:
  """The first n candidates the search would try (the default first when given); same seed, same list."""
  seen: set[str] = set()
  out = []
  if default is not None:
    out.append(dataclasses.replace(default, name="trial0"))
    seen.add(method_key(default))
  out += list(Space(t).candidates(n - len(out), seen))
  return out
