"""MTP heads in the next-token layouts of DeepSeek-V3 and Qwen3-Next / Qwen3.5: a folder with a
`config.json` (the target's fields plus `num_nextn_predict_layers`, or `mtp_num_hidden_layers`)
and safetensors (`model.safetensors`, or shards + `model.safetensors.index.json`).

Followed from vLLM's loaders: `vllm/model_executor/models/deepseek_mtp.py` (DeepSeekMTP,
DeepSeekMultiTokenPredictorLayer, `_rewrite_spec_layer_name`) and
`vllm/model_executor/models/qwen3_next_mtp.py` (Qwen3NextMultiTokenPredictor, `load_weights`):
- DeepSeek-V3 (`style` "deepseek_v3"): layer m is `model.layers.{L + m}.` (L =
  `num_hidden_layers`) with `enorm.weight`, `hnorm.weight`, `eh_proj.weight` [D, 2D] (input
  [enorm(embedding) | hnorm(hidden)]), `shared_head.norm.weight`, `shared_head.head.weight` [V, D]
  (the layer's LM head; absent = the target's), an `embed_tokens.weight` copy (not needed), and
  the decoder layer's own tensors (`input_layernorm`, `self_attn.*`, `mlp.*`, ...);
- Qwen3-Next (`style` "qwen3_next"): `mtp.fc.weight` (= eh_proj), `mtp.pre_fc_norm_embedding.weight`
  (= enorm), `mtp.pre_fc_norm_hidden.weight` (= hnorm), `mtp.layers.{m}.*` (the layer),
  `mtp.norm.weight`: fc, the two pre-fc norms and the final norm are one for every layer, and
  the LM head is the target's.

How vLLM runs them, and specjax with `MTPDrafter.style` (`specjax/drafters/mtp.py`): the target's
hidden state *after* its final norm, layer j % n at step j, the layer's own final norm before
the LM head; DeepSeek feeds the pre-norm output to the next step and zeroes the embedding at
position 0, Qwen3-Next feeds the normed output. The layer is the target family's decoder block
(specjax runs llama / qwen2 / qwen3 / mistral / gemma3 blocks and, for a Qwen3.5 hybrid target, its
gated-attention block: DeepSeek's MLA / MoE layers and MoE MLPs (Qwen3-Next, Qwen3.5-MoE) do not
fit, and their tensors are named as missing or as having no place).

Built-in layers: a Qwen3.5 HF checkpoint folder carries its own MTP layers in the Qwen3-Next layout
(`mtp.*`, counted by its text config's `mtp_num_hidden_layers`; vLLM reads them with
`vllm/model_executor/models/qwen3_5_mtp.py`, Qwen3_5MultiTokenPredictor: the fc / pre-fc norms /
final norm as above, each layer a Qwen3.5 full-attention decoder layer, the LM head the target's).
`load_reference` reads a whole checkpoint's MTP tensors alone (not the target's weights again), and
`builtin_layers` finds them for `--spec mtp` without `--head`; the layer is then the hybrid family's
gated-attention block (`specjax.models.hybrid.HybridBlock`), its norms (1 + w) like the target's.

What does not travel: a head trained by `specjax train mtp` (style "specjax") reads the target's
*pre-norm* hidden state and uses the target's final norm, so no reference layout computes what it
computes; `export_file` refuses it, saying so, rather than write a head that drafts differently.
Heads in a reference style (loaded from such a folder, or made by `init_reference_heads`) export
exactly (`export_reference`).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters.dflash_reference import write_safetensors
from specjax.drafters.head_file import (abstract_params, fused_sizes, params_from_tensors, params_of, refuse_unplaced,
                                        tensors_from)
from specjax.errors import UserError
from specjax.models.config import ModelConfig

STYLES = ("deepseek_v3", "qwen3_next")
QWEN3_NEXT_NAMES = {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
                    "eh_proj.weight": "fc.weight"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM"}


# a whole checkpoint (the target's own weights beside its MTP layers) holds one of these
TARGET_EMBEDDINGS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")


def text_fields(meta: dict) -> dict:
  """A config.json's text-model fields: a multimodal checkpoint ("qwen3_5") keeps them in `text_config`."""
  text = meta.get("text_config")
  return {**meta, **text} if isinstance(text, dict) else meta


def mtp_layer_count(meta: dict) -> int:
  """MTP layers a config.json names (`num_nextn_predict_layers` or `mtp_num_hidden_layers`); 0 if none."""
  fields = text_fields(meta)
  return int(fields.get("num_nextn_predict_layers") or fields.get("mtp_num_hidden_layers") or 0)


def _read_config(folder: Path) -> dict | None:
  try:
    return json.loads((folder / "config.json").read_text())
  except (OSError, ValueError):
    return None


def is_reference_folder(path) -> bool:
  """A folder with a config.json naming MTP layers (`num_nextn_predict_layers` or `mtp_num_hidden_layers`)."""
  meta = _read_config(Path(path))
  return meta is not None and mtp_layer_count(meta) > 0


def _safetensors_files(folder: Path, what: str) -> list[Path]:
  """The files its index.json names, else its *.safetensors; UserError when there are none."""
  index = folder / "model.safetensors.index.json"
  names = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else None
  files = sorted(folder / n for n in names) if names is not None else sorted(folder.glob("*.safetensors"))
  absent = [f.name for f in files if not f.is_file()]
  if not files or absent:
    raise UserError(f"{what} has no safetensors file{' ' + str(absent) if absent else ''}")
  return files


def _is_mtp_name(name: str, n_target: int) -> bool:
  """A tensor of an MTP layer: `mtp.*` (Qwen3-Next / Qwen3.5) or `model.layers.{>= n_target}.*` (DeepSeek-V3)."""
  parts = name.split(".")
  return parts[0] == "mtp" or (parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= n_target)


def read_mtp_tensors(folder: Path, what: str, n_target: int) -> tuple[dict, bool]:
  """(tensors, whole): every tensor of a head folder, or, when the folder is a whole checkpoint
  (`whole`: it holds the target's embedding too), its MTP layers' tensors alone."""
  keys = _tensor_keys(folder, what)
  whole = any(k in TARGET_EMBEDDINGS for _, k in keys)
  return {k: f.get_tensor(k) for f, k in keys if not whole or _is_mtp_name(k, n_target)}, whole


def _tensor_keys(folder: Path, what: str) -> list:
  """(open file, tensor name) of every tensor of the folder's safetensors (headers only: nothing read)."""
  from safetensors import safe_open
  return [(f, k) for f in (safe_open(str(p), framework="numpy") for p in _safetensors_files(folder, what))
          for k in f.keys()]


def builtin_layers(target) -> tuple[Path | None, str]:
  """(the folder, "") when the target's checkpoint carries its own MTP layers (a Qwen3.5 HF folder:
  its config names them and its safetensors hold `mtp.*` tensors), else (None, why not)."""
  name = getattr(target, "name", "") or "this target"
  source = getattr(target, "source", "") or ""
  if not source or not Path(source).is_dir():
    return None, f"{name} is not an HF checkpoint folder with MTP layers of its own (a Qwen3.5 folder's mtp.* tensors)"
  source = Path(source)
  n = mtp_layer_count(_read_config(source) or {})
  if n == 0:
    return None, f"{name}'s config.json names no MTP layers of its own (mtp_num_hidden_layers)"
  if not any(k.startswith("mtp.") for _, k in _tensor_keys(source, f"checkpoint {source}")):
    return None, (f"{name}'s config.json names {n} MTP layer{'s' * (n > 1)} but its safetensors hold no mtp.* "
                  "tensor (a checkpoint re-saved by transformers loses them)")
  return source, ""


def names_of(style: str, m: int, n_target_layers: int):
  """(prefix, file_names) of head m: file_names(param path) -> tensor names."""
  from specjax.drafters.mtp import _file_names
  if style == "deepseek_v3":
    return f"model.layers.{n_target_layers + m}.", _file_names

  def qwen3_next(path):
    return [QWEN3_NEXT_NAMES.get(n) or f"layers.{m}.{n}" for n in _file_names(path)]
  return "mtp.", qwen3_next


def out_names(style: str, m: int, n_target_layers: int) -> tuple[str, str | None]:
  """(final norm, own LM head or None) tensor names of head m."""
  if style == "deepseek_v3":
    p = f"model.layers.{n_target_layers + m}.shared_head."
    return p + "norm.weight", p + "head.weight"
  return "mtp.norm.weight", None


def init_reference_heads(cfg: ModelConfig, n_heads: int, target_params, *, seed: int = 0, own_lm_head=False):
  """(heads, outs) of `n_heads` random MTP heads in a reference style: specjax's `init_heads` plus
  each head's final norm (the target's) and, with `own_lm_head`, an LM head (the target's)."""
  from specjax.drafters.mtp import init_heads
  tp = nnx.to_pure_dict(target_params)
  heads = init_heads(cfg, n_heads, seed=seed)
  lm = tp["embed_tokens"]["embedding"] if cfg.tie_embeddings else tp["lm_head"]["kernel"]        # [V, D]
  outs = tuple({"norm": jnp.asarray(tp["norm"]["weight"]), **({"lm_head": jnp.asarray(lm)} if own_lm_head else {})}
               for _ in range(n_heads))
  return heads, outs


def reference_config(cfg: ModelConfig, n_heads: int, style: str, dtype: str) -> dict:
  """config.json: the target's HF fields (its decoder layer is the MTP layer's) + the MTP count."""
  config = {
      "architectures": [ARCHITECTURES[cfg.arch]], "model_type": cfg.arch, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": float(f"{cfg.norm_eps:.6g}"),
      "rope_theta": cfg.rope_theta, "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
      "attention_bias": cfg.qkv_bias, "torch_dtype": dtype, "num_nextn_predict_layers": n_heads,
      "specjax_mtp_style": style}
  if style == "qwen3_next":
    config["mtp_num_hidden_layers"] = n_heads
  return config


def _shared_across(heads, outs) -> bool:
  """Every head has head 0's eh_proj, enorm, hnorm and final norm, and none has its own LM head."""
  key = lambda hp, out: [np.asarray(x) for x in (hp["eh_proj"]["kernel"], hp["enorm"]["weight"],
                                                 hp["hnorm"]["weight"], out["norm"])]
  first = key(heads[0], outs[0])
  return (not any("lm_head" in o for o in outs)
          and all(all(np.array_equal(a, b) for a, b in zip(first, key(hp, o))) for hp, o in zip(heads, outs)))


def export_reference(folder, heads, outs, cfg: ModelConfig, style: str, *, dtype="bfloat16") -> Path:
  """Write reference-style heads (tuples of pure dicts: MTPHead params, {"norm", "lm_head"?}) for
  target `cfg` to `folder` in `style`'s layout. -> the folder."""
  if style not in STYLES:
    raise UserError(f"MTP style {style!r} has no reference layout; one of {STYLES}")
  if style == "qwen3_next" and not _shared_across(heads, outs):
    raise UserError("Qwen3-Next's layout has one mtp.fc / pre-fc norms / mtp.norm for every layer and the "
                    "target's LM head: these heads have their own")
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  flat = {}
  for m, (hp, out) in enumerate(zip(heads, outs)):
    prefix, names = names_of(style, m, cfg.n_layers)
    flat.update(tensors_from(params_of(hp), names, fused_sizes(cfg), dtype=dtype, prefix=prefix))
    norm_name, head_name = out_names(style, m, cfg.n_layers)
    flat[norm_name] = np.asarray(jnp.asarray(out["norm"], dtype))
    if "lm_head" in out:
      flat[head_name] = np.asarray(jnp.asarray(out["lm_head"], dtype))
  write_safetensors(flat, folder)
  config = reference_config(cfg, len(heads), style, str(jnp.dtype(dtype)))
  (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  return folder


def load_reference(folder, cfg: ModelConfig, dtype=None):
  """(heads, outs, style, config.json text fields) of a DeepSeek-V3 / Qwen3-Next layout folder for
  target `cfg`, or of a whole checkpoint's own MTP layers; UserError naming a missing, misshapen or
  unknown tensor, or a head for another target."""
  from specjax.drafters.mtp import MTPHead
  folder = Path(folder)
  what = f"MTP head {folder}"
  meta = text_fields(json.loads((folder / "config.json").read_text()))
  bad = [f"{k} {meta[k]} != {v}" for k, v in (("hidden_size", cfg.d_model), ("vocab_size", cfg.vocab_size))
         if meta.get(k) is not None and meta[k] != v]
  if bad:
    raise UserError(f"{what} does not fit this target ({cfg.arch}): {', '.join(bad)}")
  n = mtp_layer_count(meta)
  n_target = int(meta.get("num_hidden_layers", cfg.n_layers))
  flat, whole = read_mtp_tensors(folder, what, n_target)
  what = f"the MTP layers of checkpoint {folder}" if whole else what
  style = "qwen3_next" if any(k.startswith("mtp.") for k in flat) else "deepseek_v3"
  abstract = abstract_params(lambda: MTPHead(cfg, rngs=nnx.Rngs(0)))
  cast = (lambda x: jnp.asarray(x, dtype)) if dtype is not None else jnp.asarray
  heads, outs, used = [], [], set()
  for m in range(n):
    prefix, names = names_of(style, m, n_target)
    pure, got = params_from_tensors(abstract, flat, names, what=what, dtype=dtype, prefix=prefix)
    norm_name, head_name = out_names(style, m, n_target)
    if norm_name not in flat:
      raise UserError(f"{what} lacks tensor {norm_name!r}")
    out = {"norm": cast(flat[norm_name])}
    if head_name in flat:
      if flat[head_name].shape != (cfg.vocab_size, cfg.d_model):
        raise UserError(f"{what}: {head_name} has shape {flat[head_name].shape}, expected {(cfg.vocab_size, cfg.d_model)}")
      out["lm_head"] = cast(flat[head_name])
    heads.append(pure)
    outs.append(out)
    used |= got | {norm_name, head_name, f"model.layers.{n_target + m}.embed_tokens.weight"}
  refuse_unplaced(flat, used, what, "this target's MTP head")
  return tuple(heads), tuple(outs), style, meta


def export_file(head_path, out) -> Path:
  """`specjax export-head` for an MTP head: a specjax-trained head has no exact reference form."""
  raise UserError(
      f"MTP head {head_path} is a specjax head: it reads the target's pre-norm hidden state and the "
      "target's final norm, where DeepSeek-V3 / Qwen3-Next MTP layers (as vLLM runs them) read the normed "
      "hidden state and carry their own final norm; its tensors map one-to-one (enorm, hnorm, eh_proj, the "
      "layer) but it would draft differently there, so nothing is written. Heads in a reference style export "
      "with specjax.drafters.mtp_reference.export_reference")
