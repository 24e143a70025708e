"""Reading trained drafter weights (MTP, EAGLE-3, DFlash heads) out of a flat safetensors dict into
the nested parameter dict of the head's module: each head names, per parameter leaf, the file
tensors it is made of (fused leaves are several tensors concatenated on axis 0) and whether the
file stores it transposed."""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np


def leaves(tree: dict, prefix: tuple[str, ...] = ()):
  """(path of str keys, leaf) of a nested dict, depth first."""
  for key, val in tree.items():
    if isinstance(val, dict):
      yield from leaves(val, prefix + (str(key),))
    else:
      yield prefix + (str(key),), val


def fill_from_tensors(abstract: dict, flat: dict, file_names: Callable[[tuple[str, ...]], tuple[list[str], bool]], *,
                      what: str, dtype=None, prefix: str = "", int_keys: bool = False) -> tuple[dict, set]:
  """A nested dict shaped like `abstract` (leaves with .shape) from the file tensors `flat`.
  file_names(leaf path) -> (tensor names, transposed); `prefix` goes before every name; numeric
  keys become ints with `int_keys` (nnx lists). Returns (params, names used). Raises KeyError for a
  missing tensor and ValueError for a shape that does not fit; `what` names the file in messages."""
  out: dict = {}
  used: set = set()
  for path, leaf in leaves(abstract):
    names, transposed = file_names(path)
    names = [prefix + n for n in names]
    missing = [n for n in names if n not in flat]
    if missing:
      raise KeyError(f"{what} lacks tensor {missing[0]!r}")
    arr = np.concatenate([flat[n] for n in names], axis=0)
    arr = arr.T if transposed else arr
    if arr.shape != leaf.shape:
      raise ValueError(f"{what}: {names} give shape {arr.shape}, expected {leaf.shape}")
    used.update(names)
    node = out
    for p in path[:-1]:
      node = node.setdefault(int(p) if (int_keys and p.isdigit()) else p, {})
    node[path[-1]] = jnp.asarray(arr, dtype) if dtype is not None else jnp.asarray(arr)
  return out, used


def file_paths(path, stem: str):
  """(weights, config) of a head file: `X.safetensors` + `X.json` (either may be named), or a
  directory holding `<stem>.safetensors` + `<stem>.json`."""
  from pathlib import Path
  path = Path(path)
  if path.suffix == ".safetensors":
    return path, path.with_suffix(".json")
  if path.suffix == ".json":
    return path.with_suffix(".safetensors"), path
  return path / f"{stem}.safetensors", path / f"{stem}.json"


def tensors_from(pure: dict, file_names: Callable[[tuple[str, ...]], tuple[list[str], bool]],
                 fused_sizes: dict, *, dtype, prefix: str = "") -> dict:
  """The inverse of `fill_from_tensors`: file tensors (`dtype`, contiguous) of a nested parameter
  dict; a fused leaf is split on axis 0 by fused_sizes[<its module name>]."""
  flat = {}
  for path, arr in leaves(pure):
    names, transposed = file_names(path)
    arr = np.asarray(jnp.asarray(arr, dtype))
    arr = arr.T if transposed else arr
    pieces = np.split(arr, np.cumsum(fused_sizes[path[-2]])[:-1], axis=0) if len(names) > 1 else [arr]
    for name, piece in zip(names, pieces):
      flat[prefix + name] = np.ascontiguousarray(piece)
  return flat
