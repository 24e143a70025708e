"""What a speculator is to the rest of specjax: a `SpeculatorSpec` in one registry.

A spec names the speculator, says how to build its drafter for a loaded target, what it needs (a
trained head of some format, a draft model), whether it drafts chains or trees, where it drafts
(host or device), and the options it takes: a typed schema with defaults, bounds and help, checked
before anything is loaded. The CLI help, the bench and tune config checks and `api.generate`'s
`options=` all read the specs, so a new speculator is one file (its drafter) plus one
`register_speculator(...)` call, from inside the package or from user code
(`specjax.register_speculator`, an installed package's `specjax.speculators` entry point, or
`specjax --plugin MODULE`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import numbers
import sys
from pathlib import Path
from typing import Any, Callable

from specjax.errors import UserError

ENTRY_POINT_GROUP = "specjax.speculators"
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@dataclasses.dataclass(frozen=True)
class Option:
  """One option of a speculator: name, type (int, float, bool or str), default, help, and the
  values allowed (inclusive bounds, or choices); `optional` admits None."""
  name: str
  kind: type
  default: Any
  help: str = ""
  low: float | None = None
  high: float | None = None
  choices: tuple = ()
  optional: bool = False
  required: bool = False

  def __post_init__(self):
    if self.kind not in _KINDS:
      raise ValueError(f"option {self.name!r}: kind must be one of int, float, bool, str")

  def check(self, value: Any, where: str) -> Any:
    """`value` if it is allowed (ints accepted for floats), else a UserError naming `where`."""
    if value is None and (self.optional or self.default is None):
      return None
    ok = {int: lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool),
          float: lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v),
          bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str)}[self.kind]
    if not ok(value):
      raise UserError(f"{where}: {self.name} must be {_KINDS[self.kind]}, got {value!r}")
    if self.low is not None and value < self.low:
      raise UserError(f"{where}: {self.name} must be >= {self.low}, got {value!r}")
    if self.high is not None and value > self.high:
      raise UserError(f"{where}: {self.name} must be <= {self.high}, got {value!r}")
    if self.choices and value not in self.choices:
      raise UserError(f"{where}: {self.name} must be one of {list(self.choices)}, got {value!r}")
    return float(value) if self.kind is float else value

  def describe(self) -> str:
    rng = ""
    if self.choices:
      rng = f" in {list(self.choices)}"
    elif self.low is not None and self.high is not None:
      rng = f" in [{self.low}, {self.high}]"
    elif self.low is not None:
      rng = f" >= {self.low}"
    elif self.high is not None:
      rng = f" <= {self.high}"
    default = "required" if self.required else f"default {self.default!r}"
    return f"{self.name} ({self.kind.__name__}{rng}, {default}): {self.help}"


@dataclasses.dataclass(frozen=True)
class SpeculatorSpec:
  """A speculator: `build(target, *, draft_model, draft_params, head, **options) -> Drafter`.

  where: "host" (Python between jitted verification steps) or "device" (inside the jitted loop).
  chainable: it can be a member of a host chain (a device speculator with a host implementation,
  built with `device=False` there; default: where == "host"). tree: drafts token trees (their node
  budget is an option, `n_nodes` for the built-in trees; n_max caps their depth). head_format: the
  `format` of the trained head it needs (None: none), head_stem: the file stem inside a head folder.
  needs_draft_model: drafts with a second (smaller) model. committed_heads: target name -> a head
  path under the checkout's assets/, named when the head is missing. example: `example(target,
  workdir) -> dict` of `build` keyword arguments (a random head, a draft model, options) that make a
  working instance for a target with random weights; the registry-wide losslessness and
  sampling-law tests build every speculator from it (None: the defaults build one)."""
  name: str
  build: Callable
  help: str
  where: str = "host"
  chainable: bool | None = None       # can join a host chain (default: where == "host")
  tree: bool = False
  head_format: str | None = None
  head_stem: str | None = None
  needs_draft_model: bool = False
  options: tuple[Option, ...] = ()
  committed_heads: dict = dataclasses.field(default_factory=dict)
  example: Callable | None = None

  def __post_init__(self):
    if self.where not in ("host", "device"):
      raise ValueError(f"speculator {self.name!r}: where must be 'host' or 'device', got {self.where!r}")
    if self.chainable is None:
      object.__setattr__(self, "chainable", self.where == "host")
    if not self.name or "," in self.name or self.name.strip() != self.name:
      raise ValueError(f"speculator name {self.name!r}: no commas or surrounding spaces")

  @property
  def option_names(self) -> tuple[str, ...]:
    return tuple(o.name for o in self.options)

  def check_options(self, options: dict | None) -> dict:
    """The options given, checked against the schema (unknown names and bad values are errors)."""
    options = dict(options or {})
    if not isinstance(options, dict):
      raise UserError(f"{self.name}: options must be a mapping, got {type(options).__name__}")
    by_name = {o.name: o for o in self.options}
    unknown = sorted(set(options) - set(by_name))
    if unknown:
      allowed = ", ".join(by_name) or "none"
      raise UserError(f"{self.name}: unknown option(s) {unknown}; allowed: {allowed}")
    missing = [o.name for o in self.options if o.required and options.get(o.name) is None]
    if missing:
      raise UserError(f"{self.name}: option(s) {missing} required ({'; '.join(by_name[m].describe() for m in missing)})")
    return {k: by_name[k].check(v, f"{self.name} option") for k, v in options.items()}

  def defaults(self) -> dict:
    return {o.name: o.default for o in self.options}


_REGISTRY: dict[str, SpeculatorSpec] = {}
_entry_points_loaded = False


def register_speculator(spec: SpeculatorSpec, *, replace: bool = False) -> SpeculatorSpec:
  """Add a speculator (from the package or from user code); an existing name needs `replace`."""
  if not isinstance(spec, SpeculatorSpec):
    raise TypeError(f"register_speculator takes a SpeculatorSpec, got {type(spec).__name__}")
  if spec.name in _REGISTRY and not replace and _REGISTRY[spec.name] is not spec:
    raise ValueError(f"speculator {spec.name!r} is already registered (pass replace=True to override)")
  _REGISTRY[spec.name] = spec
  return spec


def unregister_speculator(name: str) -> None:
  _REGISTRY.pop(name, None)


def _load_entry_points() -> None:
  """Speculators of installed packages, declared in their `specjax.speculators` entry points (each
  names a module, or a callable run once, that registers its specs)."""
  global _entry_points_loaded
  if _entry_points_loaded:
    return
  _entry_points_loaded = True
  from importlib.metadata import entry_points
  for ep in entry_points(group=ENTRY_POINT_GROUP):
    obj = ep.load()
    if callable(obj) and not isinstance(obj, type(sys)):
      obj()


def registered() -> dict[str, SpeculatorSpec]:
  """Every registered speculator by name (built-in ones first)."""
  from specjax.drafters import registry  # noqa: F401  (registers the built-in speculators)
  _load_entry_points()
  return dict(_REGISTRY)


def names() -> tuple[str, ...]:
  return tuple(registered())


def get(name: str) -> SpeculatorSpec:
  specs = registered()
  if name not in specs:
    raise UserError(f"unknown speculator {name!r}; known: {', '.join(specs)}")
  return specs[name]


def load_plugin(module: str) -> None:
  """Import a plugin that registers speculators: a module name (`my_pkg.drafters`) or a .py path."""
  path = Path(module)
  if module.endswith(".py"):
    if not path.is_file():
      raise UserError(f"--plugin {module}: no such file")
    spec = importlib.util.spec_from_file_location(f"specjax_plugin_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return
  try:
    importlib.import_module(module)
  except ModuleNotFoundError as e:
    raise UserError(f"--plugin {module}: {e}") from None
