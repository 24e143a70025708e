"""Reading a YAML config that may change another: `base: OTHER.yaml` (a path relative to the file's
own folder) names a config whose mapping this file's mapping is merged over, key by key into nested
mappings (lists and other values replace the base's). Bench, tune and training configs are read
through `load_config`, so a variant is a few lines on the config it changes, not a copy."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def merged(base: dict, over: dict) -> dict:
  """`over` merged into `base`: nested mappings key by key, anything else replaced."""
  out = dict(base)
  for k, v in over.items():
    out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
  return out


def load_config(path: str | Path, _seen: tuple = ()) -> Any:
  """The data of a YAML config, its `base:` chain merged in (cycles and missing bases refused with a
  one-line ConfigError). A file that is not a mapping is returned as read, for the caller to name."""
  from specjax.bench.config import ConfigError, read_yaml
  path = Path(path)
  data = read_yaml(path)
  if not isinstance(data, dict) or "base" not in data:
    return data
  data = dict(data)
  base = (path.parent / str(data.pop("base"))).resolve()
  if base in _seen or base == path.resolve():
    raise ConfigError(f"{path.name}: `base:` chain loops back to {base.name}")
  if not base.exists():
    raise ConfigError(f"{path.name}: base spec {base} does not exist")
  parent = load_config(base, _seen + (path.resolve(),))
  if not isinstance(parent, dict):
    raise ConfigError(f"{base}: expected a mapping")
  return merged(parent, data)
