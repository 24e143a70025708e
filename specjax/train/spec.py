"""Loading a training spec (MTP, EAGLE-3, DFlash): a YAML file built strictly into the spec's
dataclass, then command-line overrides applied by dotted key ({"train.steps": 10, "dtype": ...};
None keeps the file's value). Each head's `load_spec` adds its own checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path


def load_train_spec(cls, path: str | Path, overrides: dict):
  import yaml

  from specjax.bench.config import ConfigError, _build
  path = Path(path)
  data = yaml.safe_load(path.read_text())
  if not isinstance(data, dict):
    raise ConfigError(f"{path}: expected a mapping")
  spec = _build(cls, data, path.name)
  for key, val in overrides.items():
    if val is None:
      continue
    section, _, field = key.rpartition(".")
    if section:
      spec = dataclasses.replace(spec, **{section: dataclasses.replace(getattr(spec, section), **{field: val})})
    else:
      spec = dataclasses.replace(spec, **{field: val})
  if spec.dtype not in ("float32", "bfloat16"):
    raise ConfigError(f"{path.name}: dtype must be float32 or bfloat16, got {spec.dtype!r}")
  return spec
