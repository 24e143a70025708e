"""Load GGUF checkpoints: metadata -> HF-style config dict, tensors -> HF-named float32 arrays.

Quantized tensors are dequantized with the `gguf` package. llama-architecture files store the
Q and K projection rows permuted for llama.cpp's interleaved rotary layout; we undo that so
that every family runs the same rotate-half rotary. Gemma files store RMSNorm weights with the
+1 of Gemma's (1 + w) already added; we take it off again.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_TO_HF = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}


def field_value(reader, key: str, default=None):
  field = reader.fields.get(key)
  if field is None:
    return default
  return field.contents()


def read_metadata(path: str | Path) -> dict[str, Any]:
  """All GGUF metadata key/values except the (large) tokenizer arrays."""
  from gguf import GGUFReader
  reader = GGUFReader(str(path))
  return {k: field_value(reader, k) for k in reader.fields
          if not k.startswith("tokenizer.ggml.") or k.endswith("_id") or k.endswith(("model", "pre"))}


def hf_config_from_metadata(meta: dict[str, Any], n_vocab: int) -> dict[str, Any]:
  arch = meta["general.architecture"]
  if arch not in _ARCH_TO_HF:
    raise ValueError(f"GGUF architecture {arch!r} is not supported; specjax runs {sorted(_ARCH_TO_HF)}")
  g = lambda k, d=None: meta.get(f"{arch}.{k}", d)
  n_heads = g("attention.head_count")
  d_model = g("embedding_length")
  hf = {
      "model_type": _ARCH_TO_HF[arch],
      "vocab_size": n_vocab,
      "hidden_size": d_model,
      "num_hidden_layers": g("block_count"),
      "num_attention_heads": n_heads,
      "num_key_value_heads": g("attention.head_count_kv", n_heads),
      "head_dim": g("attention.key_length", d_model // n_heads),
      "intermediate_size": g("feed_forward_length"),
      "rope_theta": g("rope.freq_base", 10000.0),
      "rms_norm_eps": g("attention.layer_norm_rms_epsilon", 1e-6),
      "max_position_embeddings": g("context_length"),
      "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
      "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
  }
  if arch == "gemma3":
    hf.update(sliding_window=g("attention.sliding_window"), rope_local_base_freq=10000.0,
              sliding_window_pattern=6, query_pre_attn_scalar=hf["head_dim"])
  return hf


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undo llama.cpp's rotary row permutation of a Q/K projection ([out, in] or bias [out])."""
  rows = w.shape[0]
  return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, arch: str) -> str | None:
  if gguf_name == "token_embd.weight":
    return "model.embed_tokens.weight"
  if gguf_name == "output_norm.weight":
    return "model.norm.weight"
  if gguf_name == "output.weight":
    return "lm_head.weight"
  parts = gguf_name.split(".")
  if parts[0] != "blk":
    return None
  layer, kind, leaf = parts[1], parts[2], parts[3]
  if kind == "ffn_norm":
    hf = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
  else:
    hf = _BLOCK_NAMES.get(kind)
  if hf is None:
    return None
  return f"model.layers.{layer}.{hf}.{leaf}"


def load_gguf(path: str | Path, progress: bool = True, reader=None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(HF-style config dict, {HF tensor name: float32 array [out, in]}) of a GGUF file
  (pass an open `gguf.GGUFReader` to avoid parsing the file twice)."""
  from gguf import GGUFReader
  from gguf.quants import dequantize
  reader = reader if reader is not None else GGUFReader(str(path))
  meta = {k: field_value(reader, k) for k in reader.fields if not k.startswith("tokenizer.ggml.t")
          and not k.startswith("tokenizer.ggml.merges") and not k.startswith("tokenizer.ggml.scores")}
  arch = meta["general.architecture"]
  tensors: dict[str, np.ndarray] = {}
  if any(t.name == "rope_freqs.weight" for t in reader.tensors):
    raise NotImplementedError(f"{Path(path).name}: GGUF tensor 'rope_freqs.weight' (Llama-3.x rope scaling "
                              "factors) is not supported yet; load the model's HF checkpoint folder instead")
  skipped = [t.name for t in reader.tensors if hf_name(t.name, arch) is None]
  if skipped:
    warnings.warn(f"{Path(path).name}: GGUF tensors with no place in a {arch} model, not loaded: {skipped[:8]}")
  for t in tqdm(reader.tensors, desc=f"load {Path(path).name}", disable=not progress, leave=False):
    name = hf_name(t.name, arch)
    if name is None:
      continue
    w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))
    w = w.reshape(shape) if w.size == int(np.prod(shape)) else w
    if arch == "gemma3" and name.endswith("norm.weight"):
      w = w - 1.0
    tensors[name] = w
  n_vocab = tensors["model.embed_tokens.weight"].shape[0]
  hf = hf_config_from_metadata(meta, n_vocab)
  if arch == "llama":
    for i in range(hf["num_hidden_layers"]):
      for proj, heads in (("q_proj", hf["num_attention_heads"]), ("k_proj", hf["num_key_value_heads"])):
        for leaf in ("weight", "bias"):
          key = f"model.layers.{i}.self_attn.{proj}.{leaf}"
          if key in tensors:
            tensors[key] = _unpermute_rows(tensors[key], heads)
  hf["tie_word_embeddings"] = "lm_head.weight" not in tensors
  return hf, tensors
