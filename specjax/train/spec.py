"""Loading a training spec (MTP, EAGLE-3, DFlash): a YAML file built strictly into the spec's
dataclass, then command-line overrides applied by dotted key ({"train.steps": 10, "dtype": ...};
None keeps the file's value). Each head's `load_spec` adds its own checks.

A spec may name a `base:` spec (a path relative to its own folder) that it changes
(`specjax.io.yaml_config`): its mapping is merged over the base's, key by key into nested mappings
(lists and other values replace the base's), so a second training round is a few lines, not a copy
of the data lists."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specjax.io.yaml_config import load_config as read_spec_yaml, merged  # noqa: F401  (the `base:` reader)


def load_train_spec(cls, path: str | Path, overrides: dict):
  from specjax.bench.config import ConfigError, _build
  path = Path(path)
  spec = _build(cls, read_spec_yaml(path), path.name)
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
