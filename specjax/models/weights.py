"""Map HF-named tensors (what both loaders produce) onto the NNX parameter tree of a config.

A fused projection (`qkv_proj`, `gate_up_proj`) is its HF parts' rows interleaved in groups, as
its `Linear.fused` layout says (`models/layers.py` explains the order and why): `fuse_rows` makes
it from the parts, `split_rows` gives them back (head files store the parts).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.config import ModelConfig
from specjax.models.decoder import Transformer
from specjax.models.hybrid import gated_qkv_layout
from specjax.models.hybrid_config import HybridConfig
from specjax.models.layers import Linear, fused_order, gate_up_layout, qkv_layout


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fused_layout(cfg) -> dict[str, tuple[tuple[int, ...], int]]:
  """The layout of each fused projection of a decoder layer of `cfg` (module name -> (output size
  of each HF part, groups)), as its modules declare it. A hybrid config's gated attention groups
  [q_proj (query | gate per head) | k_proj | v_proj] per KV head (`hybrid.gated_qkv_layout`)."""
  h, kvh, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  qkv = gated_qkv_layout(h, kvh, d) if isinstance(cfg, HybridConfig) else qkv_layout(h, kvh, d)
  return {"qkv_proj": qkv, "gate_up_proj": gate_up_layout(cfg.ffn_dim)}


def fuse_rows(parts, layout: tuple[tuple[int, ...], int]) -> np.ndarray:
  """HF parts [n_i, ...] ([out, in] matrices or [out] biases) -> the fused rows [sum n_i, ...] in
  the order of `layout` (`layers.fused_order`)."""
  return np.concatenate([np.asarray(p) for p in parts], axis=0)[fused_order(layout)]


def split_rows(arr, layout: tuple[tuple[int, ...], int]) -> list[np.ndarray]:
  """The inverse of `fuse_rows`: fused rows [sum(sizes), ...] -> the parts [sizes_i, ...]."""
  side = np.asarray(arr)[np.argsort(fused_order(layout))]                      # the parts side by side
  return np.split(side, np.cumsum(layout[0])[:-1], axis=0)


def fuse_parts(names: list[str], parts, layout: tuple[tuple[int, ...], int] | None) -> np.ndarray:
  """`fuse_rows` of the tensors `names` after checking their sizes against `layout` (None: the
  parts concatenated whatever their sizes). ValueError naming the tensors."""
  shapes = [np.shape(p) for p in parts]
  if layout is None:
    return np.concatenate([np.asarray(p) for p in parts], axis=0)
  if tuple(s[0] for s in shapes) != tuple(layout[0]) or len({s[1:] for s in shapes}) > 1:
    raise ValueError(f"tensor(s) {names} have shapes {shapes}, expected {tuple(layout[0])} rows of one width")
  return fuse_rows(parts, layout)


def fused_leaves(module: nnx.Module) -> dict[tuple[str, ...], tuple[tuple[int, ...], int]]:
  """Parameter path (str keys) -> layout, for every leaf (kernel, bias) of a fused projection in
  `module` (`Linear.fused`)."""
  out = {}
  for path, node in nnx.iter_graph(module):
    if isinstance(node, Linear) and node.fused is not None:
      for leaf in ("kernel", "bias"):
        if getattr(node, leaf) is not None:
          out[tuple(str(p) for p in path) + (leaf,)] = node.fused
  return out


def hf_names(path: tuple[str, ...]) -> list[str]:
  """Parameter path -> tensor names in the file, by HF's conventions: a module's `kernel` is
  `<module>.weight` ([out, in], as in memory), a `bias` is `<module>.bias`, a norm's `weight`
  stays; fused projections (qkv_proj, gate_up_proj) are stored as their HF parts."""
  parts, leaf = list(path[:-1]), path[-1]
  hf_leaf = "bias" if leaf == "bias" else "weight"
  if parts and parts[-1] in FUSED:
    return [".".join(parts[:-1] + [p, hf_leaf]) for p in FUSED[parts[-1]]]
  return [".".join(parts + [hf_leaf])]


def _hf_names(path: tuple) -> list[str]:
  """A target's parameter path -> HF tensor names (several: concatenated along the output axis)."""
  parts = tuple(str(p) for p in path)
  if parts == ("embed_tokens", "embedding"):
    return ["model.embed_tokens.weight"]
  if parts == ("lm_head", "kernel"):
    return ["lm_head.weight"]
  return ["model." + n for n in hf_names(parts)]


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=jnp.float32):
  """Parameters of `cfg` filled from HF-named tensors ([out, in] layout). Missing or misshapen
  tensors are errors that name the tensor."""
  abstract = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
  _, state = nnx.split(abstract)
  pure = nnx.to_pure_dict(state)
  layouts = fused_leaves(abstract)
  used = set()

  def fill(path, leaf):
    keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
    names = _hf_names(keys)
    missing = [n for n in names if n not in tensors]
    if missing:
      raise KeyError(f"checkpoint lacks tensor {missing[0]!r} (needed for parameter {'/'.join(map(str, keys))})")
    parts = [np.asarray(tensors[n]) for n in names]                              # [out_i, in] (or [out_i])
    arr = fuse_parts(names, parts, layouts[tuple(map(str, keys))]) if len(names) > 1 else parts[0]
    if arr.shape != leaf.shape:
      raise ValueError(f"tensor(s) {names} give shape {arr.shape}, expected {leaf.shape}")
    used.update(names)
    return jnp.asarray(arr, dtype=dtype)

  filled = jax.tree_util.tree_map_with_path(fill, pure)
  unused = sorted(n for n in tensors if n not in used and n.startswith(("model.", "lm_head."))
                  and "rotary_emb" not in n)
  if unused:
    raise ValueError(f"checkpoint tensors this {cfg.arch} config has no place for (unsupported "
                     f"variant?): {unused[:8]}{' ...' if len(unused) > 8 else ''}")
  nnx.replace_by_pure_dict(state, filled)
  return state
