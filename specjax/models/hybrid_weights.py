"""A hybrid model's parameters from an HF checkpoint (config.json + safetensors, HF tensor names)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.models.hybrid import HybridLM
from specjax.models.hybrid_config import HybridConfig, hybrid_config_from_hf
from specjax.models.weights import fuse_parts, fused_leaves

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
IGNORED_PREFIXES = ("mtp.", "model.visual.")   # Qwen3.5 MTP head and vision tower: not part of the text LM


def _hf_tensor_names(parts: list[str]) -> list[str]:
  """Our parameter path -> HF tensor names, concatenated on the output axis (matrices are
  [out, in] in HF and here; a conv1d weight is HF's [C, 1, K] squeezed)."""
  if parts == ["embed_tokens", "embedding"]:
    return ["model.embed_tokens.weight"]
  if parts == ["lm_head", "kernel"]:
    return ["lm_head.weight"]
  leaf, parent = parts[-1], parts[:-1]
  if leaf in ("A_log", "dt_bias"):
    return ["model." + ".".join(parts)]
  if leaf == "conv1d":
    return ["model." + ".".join(parts) + ".weight"]
  hf_leaf = "bias" if leaf == "bias" else "weight"
  mods = [parent[:-1] + [p] for p in FUSED[parent[-1]]] if parent[-1] in FUSED else [parent]
  return ["model." + ".".join(m + [hf_leaf]) for m in mods]


def params_from_hf(cfg: HybridConfig, tensors: Mapping[str, np.ndarray], dtype=jnp.float32):
  """Parameters of `cfg` from HF-named tensors; missing / misshapen / unplaced tensors are errors."""
  abstract = nnx.eval_shape(lambda: HybridLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
  _, state = nnx.split(abstract)
  layouts = fused_leaves(abstract)            # the MLPs' gate / up, interleaved per unit
  used = set()

  def fill(path, leaf):
    parts = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    names = _hf_tensor_names(parts)
    missing = [n for n in names if n not in tensors]
    if missing:
      raise KeyError(f"checkpoint lacks tensor {missing[0]!r} (needed for parameter {'/'.join(parts)})")
    arr = fuse_parts(names, [np.asarray(tensors[n]) for n in names], layouts.get(tuple(parts)))
    arr = arr.reshape(arr.shape[0], -1) if parts[-1] == "conv1d" else arr              # [C, 1, K] -> [C, K]
    if arr.shape != leaf.shape:
      raise ValueError(f"tensor(s) {names} give shape {arr.shape}, expected {leaf.shape}")
    used.update(names)
    return jnp.asarray(arr, dtype=dtype)

  filled = jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(state))
  if cfg.tie_embeddings:
    used.add("lm_head.weight")
  unused = sorted(n for n in tensors if n not in used and n.startswith(("model.", "lm_head."))
                  and not n.startswith(IGNORED_PREFIXES) and "rotary_emb" not in n)
  if unused:
    raise ValueError(f"checkpoint tensors this hybrid config has no place for: {unused[:8]}"
                     f"{' ...' if len(unused) > 8 else ''}")
  nnx.replace_by_pure_dict(state, filled)
  return state


def load_hybrid(path: str | Path, dtype=jnp.float32):
  """An HF hybrid checkpoint directory (config.json + *.safetensors) -> LoadedModel."""
  from specjax.io.safetensors import load_safetensors_dir
  from specjax.models.load import LoadedModel
  hf, tensors = load_safetensors_dir(path)
  cfg = hybrid_config_from_hf(hf)
  return LoadedModel(name=Path(path).name, cfg=cfg, params=params_from_hf(cfg, tensors, dtype=dtype), source=str(path))
