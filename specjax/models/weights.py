"""Map HF-named tensors (what both loaders produce) onto the NNX parameter tree of a config."""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.config import ModelConfig
from specjax.models.decoder import Transformer


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _hf_names(path: tuple) -> tuple[list[str], bool]:
  """Our parameter path -> (HF tensor names, concatenated along the output axis; transposed?)."""
  parts = [str(p) for p in path]
  if len(parts) >= 2 and parts[-2] in FUSED:
    names = []
    for part in FUSED[parts[-2]]:
      name, transposed = _hf_name(tuple(parts[:-2] + [part, parts[-1]]))
      names.append(name)
    return names, transposed
  name, transposed = _hf_name(path)
  return [name], transposed


def _hf_name(path: tuple) -> tuple[str, bool]:
  """Our parameter path -> (HF tensor name, whether HF stores it transposed)."""
  parts = [str(p) for p in path]
  if parts == ["embed_tokens", "embedding"]:
    return "model.embed_tokens.weight", False
  if parts == ["lm_head", "kernel"]:
    return "lm_head.weight", True
  leaf = parts[-1]
  transposed = leaf == "kernel"
  hf_leaf = "bias" if leaf == "bias" else "weight"
  return "model." + ".".join(parts[:-1] + [hf_leaf]), transposed


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=jnp.float32):
  """Parameters of `cfg` filled from HF-named tensors ([out, in] layout). Missing or misshapen
  tensors are errors that name the tensor."""
  abstract = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
  _, state = nnx.split(abstract)
  pure = nnx.to_pure_dict(state)
  used = set()

  def fill(path, leaf):
    keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
    names, transposed = _hf_names(keys)
    missing = [n for n in names if n not in tensors]
    if missing:
      raise KeyError(f"checkpoint lacks tensor {missing[0]!r} (needed for parameter {'/'.join(map(str, keys))})")
    arr = np.concatenate([np.asarray(tensors[n]) for n in names], axis=0)       # [out, in] stacked on out
    if transposed:
      arr = arr.T
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
