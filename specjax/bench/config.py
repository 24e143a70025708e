"""Experiment configs: dataclasses filled from YAML, strictly (unknown keys and bad values are
errors that name the key)."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any

import yaml


PLAIN_NAME = "plain"          # the harness's name of plain decoding: no method may take it
TINY_RANDOM = "tiny-random"   # target: a tiny random model (specjax.tune.tiny_model), for tests
DEFAULT_CAPACITY = 2048       # KV slots when `capacity` is not given: one size, decode loops compile once


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
  speculator: str                                   # "draft", "ngram_simple", ..., or a chain "a,b" (from
                                                    # Python also a drafter object: `make_speculator` takes one)
  draft_model: str | None = None
  head: str | None = None                           # trained head file (mtp, eagle3, dflash); from Python also a
                                                    # head in memory, as the speculator's builder takes it
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
  mesh: str | None = None                           # "data=2,model=4": the target sharded over devices (specjax.parallel)
  head_placement: str = "replicated"                # on the mesh: trained drafter heads "replicated" or "sharded"


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
    if not isinstance(value, (list, tuple)):
      return False
    args = [a for a in typing.get_args(tp) if a is not Ellipsis]
    return len(args) != 1 or all(_type_ok(v, args[0]) for v in value)
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


def _finite(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


_INT32 = 2 ** 31 - 1


def _known_model(name: str) -> bool:
  """A fetch name, the tests' random model, or an existing file / directory."""
  from specjax.io.fetch import MODELS
  return name in MODELS or name == TINY_RANDOM or Path(name).expanduser().exists()


def _check_adaptive(ad, where: str) -> None:
  """`adaptive:` is true / false, or a mapping of `specjax.engine.adaptive.AdaptiveConfig` fields."""
  if not isinstance(ad, dict):
    return
  from specjax.engine.adaptive import AdaptiveConfig
  fields = {f.name: f for f in dataclasses.fields(AdaptiveConfig)}
  unknown = sorted(set(ad) - set(fields))
  if unknown:
    raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
  for key, value in ad.items():
    if key in ("widths", "costs"):
      ok = value is None or (isinstance(value, list) and value and all(_finite(v) and v >= 0 for v in value)
                             and (key == "costs" or all(isinstance(v, int) for v in value)))
      if not ok:
        raise ConfigError(f"{where}.{key}: a non-empty list of numbers >= 0 (widths: whole numbers), got {value!r}")
    elif fields[key].type in ("bool", bool):
      if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key}: true or false, got {value!r}")
    elif fields[key].type in ("int", int):
      if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= _INT32):
        raise ConfigError(f"{where}.{key}: a whole number >= 1, got {value!r}")
    elif not (_finite(value) and value >= 0):
      raise ConfigError(f"{where}.{key}: a finite number >= 0, got {value!r}")


def _check_method(i: int, m: MethodConfig, seen: set) -> None:
  from specjax.drafters.registry import check_speculator
  from specjax.drafters.speculator_spec import names as known
  from specjax.errors import UserError
  where = f"methods[{i}]"
  if not m.name.strip() or m.name == PLAIN_NAME or m.name in seen:
    raise ConfigError(f"{where}.name: a non-empty name other than {PLAIN_NAME!r}, unique among the methods; "
                      f"got {m.name!r}")
  seen.add(m.name)
  names = [s.strip() for s in m.speculator.split(",")]
  bad = [n for n in names if n not in known()]
  if bad:
    raise ConfigError(f"{where}.speculator: unknown speculator(s) {bad}; known: {list(known())}")
  if m.policy not in ("best", "first"):
    raise ConfigError(f"{where}.policy: must be 'best' or 'first', got {m.policy!r}")
  if "draft" in names and not m.draft_model:
    raise ConfigError(f"{where}.draft_model: required for speculator 'draft'")
  if m.draft_model is not None and not _known_model(m.draft_model):
    raise ConfigError(f"{where}.draft_model: {m.draft_model!r} is neither a known model nor an existing path")
  dp = m.draft_params
  if not 1 <= dp.n_max <= _INT32 or not 0 <= dp.n_min <= dp.n_max:
    raise ConfigError(f"{where}.draft_params: need 1 <= n_max and 0 <= n_min <= n_max, got n_max={dp.n_max!r}, "
                      f"n_min={dp.n_min!r}")
  if not (_finite(dp.p_min) and 0 <= dp.p_min <= 1):
    raise ConfigError(f"{where}.draft_params.p_min: must be in [0, 1], got {dp.p_min!r}")
  _check_adaptive(m.adaptive, f"{where}.adaptive")
  # options against the speculators' schemas, chains, the kind of an existing head file: before any
  # model is loaded (a head a training stage will write is checked when the method is built)
  head = m.head if m.head and Path(m.head).exists() else None
  try:
    check_speculator(m.speculator, m.options, head=head, draft_model=m.draft_model)
  except UserError as e:                 # named by the key the registry's message is about
    key = next((k for word, k in (("draft_model", "draft_model"), ("head", "head"), ("option", "options"))
                if word in str(e)), "speculator")
    raise ConfigError(f"{where}.{key} ({m.name}): {e}") from None


def verify_width(m: MethodConfig) -> int:
  """Draft tokens a round of method `m` may verify: its n_max, or a tree's node budget (its `n_nodes`
  option; the default budget, at most `DEFAULT_NODES`, when it is not given)."""
  from specjax.drafters import speculator_spec
  from specjax.engine.tree import DEFAULT_NODES
  name = m.speculator.strip() if isinstance(m.speculator, str) else None
  if name not in speculator_spec.names() or not speculator_spec.get(name).tree:
    return m.draft_params.n_max
  opts = m.options if isinstance(m.options, dict) else {}
  opts = opts[name] if isinstance(opts.get(name), dict) else opts        # {name: {...}} or flat
  n_nodes = opts.get("n_nodes")
  return n_nodes if isinstance(n_nodes, int) and n_nodes > 0 else DEFAULT_NODES


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
  """Every check that needs no model, each error naming its key."""
  if not cfg.name.strip() or "/" in cfg.name or "\\" in cfg.name:
    raise ConfigError(f"name: a non-empty file stem (no slashes), got {cfg.name!r}")
  if not _known_model(cfg.target):
    raise ConfigError(f"target: {cfg.target!r} is neither a known model nor an existing GGUF file / HF directory")
  if cfg.dtype not in ("float32", "bfloat16", "float16"):
    raise ConfigError(f"dtype: must be float32, bfloat16 or float16, got {cfg.dtype!r}")
  if not cfg.prompts or any(not p.strip() for p in cfg.prompts):
    raise ConfigError(f"prompts: a non-empty list of prompt-set names or paths, got {list(cfg.prompts)!r}")
  if cfg.limit is not None and not 1 <= cfg.limit:
    raise ConfigError(f"limit: questions per prompt set must be >= 1 (or null: all), got {cfg.limit!r}")
  for key in ("turns", "max_new_tokens", "batch_size", "repeats"):
    value = getattr(cfg, key)
    if not 1 <= value <= _INT32:
      raise ConfigError(f"{key}: must be a whole number in [1, 2**31), got {value!r}")
  if not 0 <= cfg.seed < 2 ** 32:
    raise ConfigError(f"seed: must be in [0, 2**32), got {cfg.seed!r}")
  if cfg.mesh is not None:
    from specjax.errors import UserError
    from specjax.parallel.mesh import parse_mesh
    try:
      data = parse_mesh(cfg.mesh)["data"]
    except UserError as e:
      raise ConfigError(f"mesh: {str(e).removeprefix('mesh: ')}") from None
    if cfg.batch_size % data:
      raise ConfigError(f"mesh: the data axis ({data}) must divide batch_size ({cfg.batch_size})")
  from specjax.parallel.partition import HEAD_PLACEMENTS
  if cfg.head_placement not in HEAD_PLACEMENTS:
    raise ConfigError(f"head_placement: must be one of {', '.join(HEAD_PLACEMENTS)}, got {cfg.head_placement!r}")
  widest = max([verify_width(m) for m in cfg.methods] + [0])
  capacity = DEFAULT_CAPACITY if cfg.capacity is None else cfg.capacity
  if capacity < cfg.max_new_tokens + widest + 2 or capacity > _INT32:
    raise ConfigError(f"{'capacity' if cfg.capacity is not None else 'max_new_tokens'}: the KV cache "
                      f"({capacity} slots{'' if cfg.capacity is not None else ', the default capacity'}) must hold "
                      f"the prompt + max_new_tokens ({cfg.max_new_tokens}) + the widest draft ({widest}: n_max, or "
                      f"a tree's n_nodes) + 1")
  s = cfg.sampling
  if not (_finite(s.temperature) and s.temperature >= 0):
    raise ConfigError(f"sampling.temperature: must be a finite number >= 0, got {s.temperature!r}")
  if not 0 <= s.top_k <= _INT32:
    raise ConfigError(f"sampling.top_k: must be >= 0 (0 = off), got {s.top_k!r}")
  if not (_finite(s.top_p) and 0 < s.top_p <= 1):
    raise ConfigError(f"sampling.top_p: must be in (0, 1], got {s.top_p!r}")
  seen: set = set()
  for i, m in enumerate(cfg.methods):
    _check_method(i, m, seen)
  return cfg


def config_from_dict(data: dict, where: str = "config") -> ExperimentConfig:
  cfg = _build(ExperimentConfig, data, where)
  try:
    return validate(cfg)
  except ConfigError as e:             # named as _build names keys: <where>.<key>
    raise ConfigError(f"{where}.{e}") from None


def read_yaml(path: str | Path) -> Any:
  """A YAML file's data; a missing, unreadable or malformed file is a one-line ConfigError."""
  path = Path(path)
  try:
    text = path.read_text(encoding="utf-8")
  except FileNotFoundError:
    raise ConfigError(f"{path}: no such config file") from None
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(f"{path}: cannot read the config ({type(e).__name__}: {e})") from None
  try:
    data = yaml.safe_load(text)
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    raise ConfigError(f"{path}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
  if data is None:
    raise ConfigError(f"{path}: empty config")
  return data


def load_config(path: str | Path, **overrides) -> ExperimentConfig:
  from specjax.io.yaml_config import load_config as load_yaml_config
  path = Path(path)
  data = load_yaml_config(path)                 # `base:` chains merged in
  if isinstance(data, dict):
    data = {**data, **{k: v for k, v in overrides.items() if v is not None}}
  return config_from_dict(data, where=path.name)


def to_dict(cfg) -> dict:
  return dataclasses.asdict(cfg)
