"""DFlash drafters in z-lab's layout: a folder with a Qwen3-style `config.json` (architectures
["DFlashDraftModel"], `dflash_config` {mask_token_id, target_layer_ids}, `block_size`) and
`model.safetensors` (or `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`).

Followed from z-lab/dflash `model/dflash.py` and `dflash/model.py` (DFlashDraftModel,
Qwen3DFlashAttention, extract_context_feature, dflash_generate) and the loader of
vllm-project/tpu-inference `tpu_inference/models/jax/qwen3_dflash.py` (Qwen3DFlashWeightLoader):
- tensors (an optional `model.` prefix): `fc.weight` [D, n_taps * D], `hidden_norm.weight`,
  `norm.weight`, `layers.{i}.{input_layernorm, post_attention_layernorm}.weight`,
  `layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
  `layers.{i}.mlp.{gate,up,down}_proj.weight`; an `embed_tokens.weight` copy is not needed (the
  drafter uses the target's embedding and LM head);
- config: `hidden_size` (the target's), `intermediate_size`, `num_hidden_layers`,
  `num_attention_heads`, `num_key_value_heads`, `head_dim`, `rms_norm_eps`, `rope_theta`,
  `attention_bias`, `block_size`, `num_target_layers`, `dflash_config.target_layer_ids` (HF's
  `hidden_states[i + 1]`: the output of target layer i, specjax's `taps`) and
  `dflash_config.mask_token_id`.

The math, exactly as specjax's `DFlashConfig(mask_token_id=..., final_norm=True,
layer_fields=REFERENCE_LAYER + sizes)`: the block is [last, MASK x (B-1)] with MASK = the target's
embedding of `mask_token_id`; each layer's keys/values are its k/v projections (k_norm, rotary at
their positions) of hidden_norm(fc(taps)) followed by the block's, non-causal; the drafter's own
`norm`, then the target's LM head. A specjax drafter with a *learned* MASK vector cannot become a
token id, and one on the target's final norm or on layers without QK-norm computes something else:
`export_reference` refuses those (naming why) instead of writing a drafter that drafts differently;
train with `drafter: {reference_layout: true, mask_token_id: ID}` to get an exportable one.
Two limits on either side: z-lab attends to the whole context where specjax keeps the last `window`
positions (identical while the context fits), and HF's last hidden state is after the final norm,
so a tap on the target's last layer is refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp

from specjax.drafters.head_file import fused_sizes, params_of, shard_groups, tensors_from
from specjax.errors import UserError
from specjax.models.config import ModelConfig

ARCHITECTURE = "DFlashDraftModel"
NOT_NEEDED = ("embed_tokens.weight",)
# z-lab's layers are Qwen3 layers whatever the target: QK-norm, SiLU MLP, plain RMSNorm weights
REFERENCE_LAYER = {"arch": "qwen3", "qk_norm": True, "sandwich_norm": False, "norm_offset": False,
                   "activation": "silu", "query_scale": None, "rope_local_theta": None}
MAX_SHARD_BYTES = 5_000_000_000


def is_reference_folder(path) -> bool:
  """A folder whose config.json names a DFlash draft architecture (z-lab's)."""
  cfg = Path(path) / "config.json"
  if not cfg.is_file():
    return False
  try:
    return any("DFlash" in a for a in (json.loads(cfg.read_text()).get("architectures") or []))
  except ValueError:
    return False


def exportable(cfg: ModelConfig, dc) -> list[str]:
  """Why drafter config `dc` for target `cfg` has no exact z-lab form ([] = it has one)."""
  from specjax.drafters.dflash import layer_config
  lc = layer_config(cfg, dc)
  why = []
  if dc.mask_token_id is None:
    why.append("its MASK embedding is a learned vector (z-lab takes the target's embedding of mask_token_id)")
  if not dc.final_norm:
    why.append("it uses the target's final norm (z-lab's drafter has its own `norm`)")
  if not lc.qk_norm or lc.norm_offset or lc.sandwich_norm or lc.activation != "silu" or lc.query_scale:
    why.append(f"its layers are {lc.arch} layers, not Qwen3 ones (QK-norm, SiLU, plain RMSNorm)")
  if lc.qkv_bias != lc.o_bias or lc.rope_scaling:
    why.append("its attention biases or rope scaling have no z-lab config field")
  if cfg.embed_scale:
    why.append("the target scales its embeddings (z-lab embeds unscaled)")
  if max(dc.taps) >= cfg.n_layers - 1:
    why.append(f"it taps the target's last layer {cfg.n_layers - 1} (HF's last hidden state is normed)")
  return why


def reference_config(cfg: ModelConfig, dc, dtype: str) -> dict:
  """z-lab's config.json of drafter `dc` for target `cfg`."""
  from specjax.drafters.dflash import layer_config
  lc = layer_config(cfg, dc)
  return {
      "architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": cfg.d_model,
      "intermediate_size": lc.ffn_dim, "num_hidden_layers": dc.n_layers, "num_attention_heads": lc.n_heads,
      "num_key_value_heads": lc.n_kv_heads, "head_dim": lc.head_dim, "rms_norm_eps": float(f"{lc.norm_eps:.6g}"),
      "rope_theta": lc.rope_theta, "max_position_embeddings": 32768, "vocab_size": cfg.vocab_size,
      "attention_bias": bool(lc.qkv_bias), "hidden_act": "silu", "tie_word_embeddings": False,
      "use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * dc.n_layers,
      "torch_dtype": dtype, "block_size": dc.block_size, "num_target_layers": cfg.n_layers,
      "dflash_config": {"mask_token_id": dc.mask_token_id, "target_layer_ids": list(dc.taps)},
      "specjax": {"window": dc.window}}


def write_safetensors(flat: dict, folder: Path, max_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
  """`model.safetensors`, or HF shards `model-0000k-of-0000n.safetensors` with
  `model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map"}) past max_bytes."""
  from safetensors.numpy import save_file
  groups = shard_groups(flat, max_bytes)
  n = len(groups)
  names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
  for name, group in zip(names, groups):
    save_file({k: flat[k] for k in group}, str(folder / name), metadata={"format": "pt"})
  if n > 1:
    index = {"metadata": {"total_size": sum(a.nbytes for a in flat.values())},
             "weight_map": {k: name for name, group in zip(names, groups) for k in group}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
  return [folder / name for name in names]


def read_safetensors(folder: Path, what: str) -> dict:
  """Every tensor of a folder: the files its index.json names, else its *.safetensors."""
  from safetensors.numpy import load_file
  index = folder / "model.safetensors.index.json"
  if index.is_file():
    files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
  else:
    files = sorted(folder.glob("*.safetensors"))
  missing = [f.name for f in files if not f.is_file()]
  if not files or missing:
    raise UserError(f"{what} has no safetensors file{' ' + str(missing) if missing else ''}")
  flat = {}
  for f in files:
    flat.update(load_file(str(f)))
  return flat


def export_reference(folder, dparams, cfg: ModelConfig, dc, *, dtype="bfloat16",
                     max_bytes: int = MAX_SHARD_BYTES) -> Path:
  """Write drafter `dparams` (pure dict) with its DFlashConfig for target `cfg` to `folder` in z-lab's
  layout; UserError when it has no exact z-lab form. -> the folder."""
  from specjax.drafters.dflash import _names, layer_config
  why = exportable(cfg, dc)
  if why:
    raise UserError("this DFlash drafter has no exact z-lab form: " + "; ".join(why)
                    + ". Train one with drafter: {reference_layout: true, mask_token_id: ID}")
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  flat = tensors_from(params_of(dparams), _names, fused_sizes(layer_config(cfg, dc)), dtype=dtype)
  write_safetensors(flat, folder, max_bytes)
  config = reference_config(cfg, dc, str(jnp.dtype(dtype)))
  (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  return folder


def _field(meta: dict, name: str, default=None):
  """z-lab's lookup: dflash_config first, then the config's top level."""
  return (meta.get("dflash_config") or {}).get(name, meta.get(name, default))


def _default_taps(n_target: int, n_draft: int) -> list[int]:
  """z-lab's build_target_layer_ids, for a config without dflash_config.target_layer_ids."""
  if n_draft == 1:
    return [n_target // 2]
  return [round(1 + i * (n_target - 4) / (n_draft - 1)) for i in range(n_draft)]


def config_from_reference(meta: dict, cfg: ModelConfig, what: str):
  """The DFlashConfig of a z-lab config.json for target `cfg`; UserError for what specjax cannot run
  exactly."""
  from specjax.drafters.dflash import DFlashConfig
  bad = [f"{k} {meta[k]} != {v}" for k, v in (("hidden_size", cfg.d_model), ("vocab_size", cfg.vocab_size))
         if meta.get(k) is not None and meta[k] != v]
  if bad:
    raise UserError(f"{what} does not fit this target ({cfg.arch}): {', '.join(bad)}")
  if ARCHITECTURE not in (meta.get("architectures") or []):
    raise UserError(f"{what}: architecture {meta.get('architectures')} is not {ARCHITECTURE} (DFlash 2 is not supported)")
  n_layers = int(meta["num_hidden_layers"])
  taps = _field(meta, "target_layer_ids") or _default_taps(int(meta.get("num_target_layers", cfg.n_layers)), n_layers)
  mask_id = _field(meta, "mask_token_id")
  rope = (meta.get("rope_parameters") or {}).get("rope_theta", meta.get("rope_theta", 10000.0))
  scaling = meta.get("rope_scaling") or {}
  unsupported = [
      (mask_id is None, "no mask_token_id"),
      (mask_id is not None and not 0 <= int(mask_id) < cfg.vocab_size, f"mask_token_id {mask_id} outside the vocabulary"),
      (list(taps) != sorted(set(taps)), f"target_layer_ids {taps} are not ascending"),
      (max(taps) >= cfg.n_layers - 1, f"target_layer_ids {taps} reach the target's last layer {cfg.n_layers - 1}"),
      (any(t != "full_attention" for t in meta.get("layer_types") or []) or meta.get("use_sliding_window")
       or _field(meta, "is_causal"), "sliding-window or causal layers"),
      (scaling.get("rope_type", scaling.get("type", "default")) != "default", f"rope scaling {scaling}"),
      (float(_field(meta, "input_embedding_scale", 1.0)) != 1.0 or float(_field(meta, "output_multiplier", 1.0)) != 1.0
       or _field(meta, "final_logit_softcapping"), "embedding / logit scaling"),
      (cfg.embed_scale, "a target that scales its embeddings")]
  why = [w for bad_, w in unsupported if bad_]
  if why:
    raise UserError(f"{what}: specjax cannot run this z-lab drafter exactly: {'; '.join(why)}")
  n_heads = int(meta["num_attention_heads"])
  bias = bool(meta.get("attention_bias", False))
  fields = {**REFERENCE_LAYER, "n_heads": n_heads, "n_kv_heads": int(meta.get("num_key_value_heads", n_heads)),
            "head_dim": int(meta.get("head_dim") or cfg.d_model // n_heads), "norm_eps": float(meta.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(rope), "rope_scaling": (), "qkv_bias": bias, "o_bias": bias}
  window = int((meta.get("specjax") or {}).get("window", 256))
  return DFlashConfig(taps=tuple(taps), n_layers=n_layers, block_size=int(_field(meta, "block_size", 16)),
                      window=window, ffn_dim=int(meta["intermediate_size"]), mask_token_id=int(mask_id),
                      final_norm=True, layer_fields=tuple(fields.items()))


def load_reference(folder, cfg: ModelConfig, dtype=None):
  """(drafter params as a pure dict, DFlashConfig, config.json) of a z-lab folder for target `cfg`;
  UserError naming a missing tensor, a tensor with no place, or a config specjax cannot run exactly."""
  from specjax.drafters.dflash import read_drafter_tensors
  folder = Path(folder)
  what = f"DFlash drafter {folder}"
  meta = json.loads((folder / "config.json").read_text())
  dc = config_from_reference(meta, cfg, what)
  flat = {k.removeprefix("model."): v for k, v in read_safetensors(folder, what).items()}
  for name in NOT_NEEDED:
    flat.pop(name, None)
  return read_drafter_tensors(flat, cfg, dc, what, dtype), dc, meta


def export_file(head_path, out, *, max_bytes: int = MAX_SHARD_BYTES) -> Path:
  """A specjax DFlash drafter file (`X.safetensors` + `X.json`, or its folder) rewritten in z-lab's
  layout under `out`, for the target recorded in its JSON."""
  from specjax.drafters.dflash import drafter_paths, load_dflash
  _, cpath = drafter_paths(head_path)
  meta = json.loads(cpath.read_text())
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  tc = meta["target_config"]
  cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in tc.items() if k in fields})
  dparams, dc, _ = load_dflash(head_path, cfg)
  return export_reference(out, dparams, cfg, dc, dtype=meta.get("dtype", "bfloat16"), max_bytes=max_bytes)
