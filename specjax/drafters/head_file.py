"""A trained drafter's file (MTP, EAGLE-3, DFlash heads), shared by every kind of head:

- the module / parameter split: a head is defined as a Flax NNX module and travels as a pure dict
  of its parameters (`params_of`, `abstract_params`), merged back into the module inside a trace
  (`graphdef_of`);
- the file: `X.safetensors` (HF-style tensor names, [out, in] layout, fused projections stored as
  their parts; in shards past ~19 MB) beside `X.json` (the head's kind as `format`, its shape, the
  target config it was trained for), or a folder holding `<stem>.safetensors` + `<stem>.json`
  (`save_head`, `load_head`);
- the mapping between the two: each head names, per parameter leaf, the file tensors it is made
  of (a fused leaf is several tensors, their rows interleaved on axis 0 as the projection's
  `Linear.fused` layout says; `weights.hf_names`, `tensors_from`,
  `params_from_tensors`). Matrices are [out, in] in files and in memory alike. Files hold the
  parts, never a fused matrix, so a file does not depend on the layout of the fused parameters in
  memory.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.errors import UserError
from specjax.models.weights import fuse_parts, fused_layout, fused_leaves, split_rows


def params_of(params) -> dict:
  """The pure dict of a module's parameters (a module, an nnx.State, or already a pure dict)."""
  if isinstance(params, nnx.Module):
    params = nnx.split(params)[1]
  return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params


def graphdef_of(make: Callable[[], nnx.Module]):
  """The graph definition of the module `make()` builds, without allocating its parameters (merge it
  with a pure dict of parameters inside a trace: `nnx.merge(graphdef, params)`)."""
  return nnx.split(nnx.eval_shape(make))[0]


@dataclasses.dataclass(frozen=True)
class FusedShape:
  """An abstract leaf of a fused projection: its shape and dtype, and its layout (`Linear.fused`)."""
  shape: tuple[int, ...]
  dtype: object
  layout: tuple[tuple[int, ...], int]


def abstract_params(make: Callable[[], nnx.Module]) -> dict:
  """The parameter tree of `make()` as a pure dict of shapes (what a file is read into); leaves of
  fused projections are `FusedShape`s, which say how the file's parts make them."""
  module = nnx.eval_shape(make)
  layouts = fused_leaves(module)

  def leaf(path, x):
    names = tuple(str(getattr(k, "key", k)) for k in path)
    return FusedShape(tuple(x.shape), x.dtype, layouts[names]) if names in layouts else x
  return jax.tree_util.tree_map_with_path(leaf, nnx.to_pure_dict(nnx.split(module)[1]))


def fused_sizes(cfg) -> dict[str, tuple[tuple[int, ...], int]]:
  """How each fused projection of a decoder layer of config `cfg` is made of its parts: module
  name -> (axis-0 size of each part, groups) (`weights.fused_layout`)."""
  return fused_layout(cfg)


def leaves(tree: dict, prefix: tuple[str, ...] = ()):
  """(path of str keys, leaf) of a nested dict, depth first."""
  for key, val in tree.items():
    if isinstance(val, dict):
      yield from leaves(val, prefix + (str(key),))
    else:
      yield prefix + (str(key),), val


def fill_from_tensors(abstract: dict, flat: dict, file_names: Callable[[tuple[str, ...]], list[str]], *,
                      what: str, dtype=None, prefix: str = "", int_keys: bool = False) -> tuple[dict, set]:
  """A nested dict shaped like `abstract` (leaves with .shape) from the file tensors `flat`.
  file_names(leaf path) -> tensor names; `prefix` goes before every name; numeric
  keys become ints with `int_keys` (nnx lists); a fused leaf (`FusedShape`) is its tensors' rows
  interleaved by its layout (`weights.fuse_rows`). Returns (params, names used). Raises KeyError
  for a missing tensor and ValueError for a shape that does not fit; `what` names the file in
  messages."""
  out: dict = {}
  used: set = set()
  for path, leaf in leaves(abstract):
    names = [prefix + n for n in file_names(path)]
    missing = [n for n in names if n not in flat]
    if missing:
      raise KeyError(f"{what} lacks tensor {missing[0]!r}")
    try:
      arr = fuse_parts(names, [flat[n] for n in names], getattr(leaf, "layout", None)) if len(names) > 1 \
          else flat[names[0]]
    except ValueError as e:
      raise ValueError(f"{what}: {e}") from None
    if tuple(arr.shape) != tuple(leaf.shape):
      raise ValueError(f"{what}: {names} give shape {arr.shape}, expected {leaf.shape}")
    used.update(names)
    node = out
    for p in path[:-1]:
      node = node.setdefault(int(p) if (int_keys and p.isdigit()) else p, {})
    node[path[-1]] = jnp.asarray(arr, dtype) if dtype is not None else jnp.asarray(arr)
  return out, used


def params_from_tensors(abstract: dict, flat: dict, file_names, *, what: str, dtype=None, prefix: str = "",
                        int_keys: bool = False) -> tuple[dict, set]:
  """`fill_from_tensors`, with a missing or misshapen tensor as a UserError naming it."""
  try:
    return fill_from_tensors(abstract, flat, file_names, what=what, dtype=dtype, prefix=prefix, int_keys=int_keys)
  except (KeyError, ValueError) as e:
    raise UserError(str(e).strip("'\"")) from None


def refuse_unplaced(flat: dict, used: set, what: str, whose: str = "this head") -> None:
  """A UserError naming the file tensors of `flat` that no parameter took (a head of another shape)."""
  unused = sorted(set(flat) - set(used))
  if unused:
    raise UserError(f"{what} has tensors {whose} has no place for: {unused[:6]}")


def check_target(meta: dict, cfg, keys: tuple[str, ...], what: str, *, strict: bool = False) -> None:
  """A UserError when the target config a head was trained for (its JSON's `target_config`) differs
  from `cfg` in one of `keys`; a key the file does not record passes unless `strict`."""
  got, want = meta.get("target_config", {}), dataclasses.asdict(cfg)
  bad = [k for k in keys if (strict or k in got) and got.get(k) != want[k]]
  if bad:
    raise UserError(f"{what} was trained for another target: "
                    + ", ".join(f"{k} {got.get(k)} != {want[k]}" for k in bad))


def file_paths(path, stem: str):
  """(weights, config) of a head file: `X.safetensors` + `X.json` (either may be named), or a
  directory holding `<stem>.safetensors` + `<stem>.json`."""
  path = Path(path)
  if path.suffix == ".safetensors":
    return path, path.with_suffix(".json")
  if path.suffix == ".json":
    return path.with_suffix(".safetensors"), path
  return path / f"{stem}.safetensors", path / f"{stem}.json"


def tensors_from(pure: dict, file_names: Callable[[tuple[str, ...]], list[str]],
                 fused_sizes: dict, *, dtype, prefix: str = "") -> dict:
  """The inverse of `fill_from_tensors`: file tensors (`dtype`, contiguous) of a nested parameter
  dict; a fused leaf is split into its parts by the layout fused_sizes[<its module name>]."""
  flat = {}
  for path, arr in leaves(pure):
    names = file_names(path)
    arr = np.asarray(jnp.asarray(arr, dtype))
    pieces = split_rows(arr, fused_sizes[path[-2]]) if len(names) > 1 else [arr]
    for name, piece in zip(names, pieces):
      flat[prefix + name] = np.ascontiguousarray(piece)
  return flat


# files kept under this size each (repositories and registries often refuse larger ones); a head
# past it is written as `X.safetensors` plus shards `X-2.safetensors`, ... named in X's metadata
MAX_FILE_BYTES = 19_000_000


def shard_groups(flat: dict, max_bytes: int) -> list[list[str]]:
  """Tensor names in order, grouped into shards of at most ~max_bytes (a larger tensor gets a
  shard of its own)."""
  groups, size = [[]], 0
  for name, arr in flat.items():
    if groups[-1] and size + arr.nbytes > max_bytes:
      groups.append([])
      size = 0
    groups[-1].append(name)
    size += arr.nbytes
  return groups


def save_tensors(flat: dict, wpath, metadata: dict, max_bytes: int = MAX_FILE_BYTES) -> list:
  """Write file tensors `flat` to `wpath` (safetensors), in shards of at most ~max_bytes when they
  are larger: the first file's metadata "shards" lists the others (comma-separated names in the
  same folder). Tensors keep their order; one larger than max_bytes gets a shard of its own.
  -> the files written."""
  from safetensors.numpy import save_file
  wpath = Path(wpath)
  groups = shard_groups(flat, max_bytes)
  names = [wpath] + [wpath.with_name(f"{wpath.stem}-{i + 1}{wpath.suffix}") for i in range(1, len(groups))]
  for old in wpath.parent.glob(f"{wpath.stem}-*{wpath.suffix}"):   # shards of an earlier, larger save
    if old.stem[len(wpath.stem) + 1:].isdigit() and old not in names:
      old.unlink()
  meta = {k: str(v) for k, v in metadata.items()}
  if len(groups) > 1:
    meta["shards"] = ",".join(p.name for p in names[1:])
  for i, (path, group) in enumerate(zip(names, groups)):
    save_file({n: flat[n] for n in group}, str(path), metadata=meta if i == 0 else {"shard_of": wpath.name})
  return names


def load_tensors(wpath) -> dict:
  """The file tensors of `wpath` and of the shards its metadata names (`save_tensors`)."""
  from safetensors import safe_open
  from safetensors.numpy import load_file
  wpath = Path(wpath)
  with safe_open(str(wpath), framework="numpy") as f:
    shards = (f.metadata() or {}).get("shards", "")
  flat = load_file(str(wpath))
  for name in filter(None, shards.split(",")):
    shard = wpath.with_name(name)
    if not shard.exists():
      raise FileNotFoundError(f"{wpath} names shard {name}, which is not beside it")
    flat.update(load_file(str(shard)))
  return flat


# the `format` field of each head kind's JSON config, and what the head is called in messages
HEAD_KINDS = {"specjax-mtp-v1": "an MTP head", "specjax-eagle3-v1": "an EAGLE-3 head",
              "specjax-dflash-v1": "a DFlash drafter"}
# each head kind's file stem and the module whose `export_file(head, out)` writes its reference layout
EXPORTERS = {"specjax-eagle3-v1": ("eagle3_head", "specjax.drafters.eagle3_reference"),
             "specjax-dflash-v1": ("dflash", "specjax.drafters.dflash_reference"),
             "specjax-mtp-v1": ("mtp_head", "specjax.drafters.mtp_reference")}


def head_paths(path, kind: str) -> tuple[Path, Path]:
  """(weights, config) of a head of format `kind`: `X.safetensors` + `X.json`, or a folder with the
  kind's stem (`mtp_head`, `eagle3_head`, `dflash`)."""
  return file_paths(path, EXPORTERS[kind][0])


def save_head(path, kind: str, tensors: dict, config: dict, *, tensor_metadata: dict | None = None) -> tuple[Path, Path]:
  """Write a head of format `kind`: its file tensors as safetensors (metadata: the format, and
  `tensor_metadata`; in shards past ~19 MB, `save_tensors`) and its JSON config {"format": kind,
  **config}. -> (weights, config) paths."""
  wpath, cpath = head_paths(path, kind)
  wpath.parent.mkdir(parents=True, exist_ok=True)
  save_tensors(tensors, wpath, {"format": kind, **(tensor_metadata or {})})
  cpath.write_text(json.dumps({"format": kind, **config}, indent=1, default=str) + "\n")
  return wpath, cpath


def load_head(path, kind: str, *, config_optional: bool = False) -> tuple[dict, dict, Path]:
  """(file tensors, JSON config, weights path) of a head of format `kind` written by `save_head`
  (shards included); a missing config is {} when `config_optional`."""
  wpath, cpath = head_paths(path, kind)
  if not wpath.exists():
    raise FileNotFoundError(f"no {HEAD_KINDS[kind].split(' ', 1)[1]} weights at {wpath}")
  meta = json.loads(cpath.read_text()) if cpath.exists() or not config_optional else {}
  return load_tensors(wpath), meta, wpath


def check_head_file(path, stem: str, fmt: str, *, config_optional: bool = False):
  """(weights, config) paths of a head for a speculator that needs format `fmt`, after the checks
  that need no model: both files exist, the JSON parses and is of that kind (not another kind of
  head), and the weights (and the shards they name) are safetensors files. Raises UserError."""
  from safetensors import safe_open

  wpath, cpath = file_paths(path, stem)
  want = HEAD_KINDS[fmt]
  if not wpath.is_file():
    raise UserError(f"head {path}: no weights file {wpath}")
  meta = {}
  if cpath.is_file():
    try:
      meta = json.loads(cpath.read_text())
    except (ValueError, UnicodeDecodeError) as e:
      raise UserError(f"head config {cpath} is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
      raise UserError(f"head config {cpath} is not a JSON object")
  elif not config_optional:
    raise UserError(f"head {path}: no config file {cpath} beside its weights")
  got = meta.get("format")
  if cpath.is_file() and got != fmt:
    kind = HEAD_KINDS.get(got, f"a file of format {got!r}" if got else "not a specjax head config")
    raise UserError(f"head {wpath} is {kind}; this speculator needs {want} ({fmt})")
  files, i = [wpath], 0
  while i < len(files):
    if not files[i].is_file():
      raise UserError(f"head weights {wpath} name shard {files[i].name}, which is not beside them")
    try:
      with safe_open(str(files[i]), framework="numpy") as f:
        if i == 0:
          files += [wpath.with_name(n) for n in filter(None, (f.metadata() or {}).get("shards", "").split(","))]
    except Exception as e:        # safetensors raises its own error type for a bad header
      why = str(e).splitlines()[0] if str(e) else "unreadable"
      raise UserError(f"head weights {files[i]} are not a readable safetensors file ({why})") from None
    i += 1
  return wpath, cpath


def head_format(path) -> str | None:
  """The specjax format of a head file (its JSON's `format`, else its safetensors metadata's), or None."""
  from safetensors import safe_open
  for fmt, (stem, _) in EXPORTERS.items():
    wpath, cpath = file_paths(path, stem)
    try:
      if cpath.is_file():
        got = json.loads(cpath.read_text()).get("format")
      elif wpath.is_file():
        with safe_open(str(wpath), framework="numpy") as f:
          got = (f.metadata() or {}).get("format")
      else:
        continue
    except (ValueError, OSError, AttributeError):
      continue
    if got in EXPORTERS:
      return got
  return None


def export_head(path, out):
  """A specjax head of any kind rewritten in its reference layout under `out` (the head's kind picks
  the exporter). -> the folder written."""
  import importlib

  fmt = head_format(path)
  if fmt is None:
    raise UserError(f"{path}: not a specjax EAGLE-3, DFlash or MTP head (X.safetensors beside X.json, or its folder)")
  return importlib.import_module(EXPORTERS[fmt][1]).export_file(path, out)
