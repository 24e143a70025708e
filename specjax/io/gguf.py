"""Load GGUF checkpoints: metadata -> HF-style config dict, tensors -> HF-named float32 arrays.

Quantized tensors are dequantized with the `gguf` package. llama-architecture files store the
Q and K projection rows permuted for llama.cpp's interleaved rotary layout; we undo that so
that every family runs the same rotate-half rotary. Gemma files store RMSNorm weights with the
+1 of Gemma's (1 + w) already added; we take it off again. Llama-3.x files carry their rope
scaling as `rope_freqs.weight`, one divisor per rotary frequency (llama.cpp's freq_factors): it
becomes the config's ("freq_factors", ...) scaling.

Tensors are dequantized lazily, one per access (`GGUFTensors`), and the pages of the memory-mapped
file a tensor touched are released after it is read, so a loader that moves each tensor to the
device before asking for the next holds about one tensor on the host.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import numpy as np

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
  if parts[0] != "blk" or len(parts) != 4:
    return None
  layer, kind, leaf = parts[1], parts[2], parts[3]
  if kind == "ffn_norm":
    hf = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
  else:
    hf = _BLOCK_NAMES.get(kind)
  if hf is None:
    return None
  return f"model.layers.{layer}.{hf}.{leaf}"


class GGUFTensors(Mapping):
  """{HF tensor name: float32 array [out, in]} of a GGUF file's tensors, dequantized on access;
  llama Q / K rows unpermuted, Gemma norm weights less their +1."""

  def __init__(self, reader, arch: str, n_heads: int, n_kv_heads: int):
    self._reader, self._arch = reader, arch
    self._heads = {"q_proj": n_heads, "k_proj": n_kv_heads}
    self._by_name = {hf_name(t.name, arch): t for t in reader.tensors if t.name != "rope_freqs.weight"}

  def __getitem__(self, name: str) -> np.ndarray:
    from gguf.quants import dequantize
    t = self._by_name[name]
    w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))
    w = w.reshape(shape) if w.size == int(np.prod(shape)) else w
    if self._arch == "gemma3" and name.endswith("norm.weight"):
      w = w - 1.0
    proj = name.split(".")[-2]
    if self._arch == "llama" and proj in self._heads and ".self_attn." in name:
      w = _unpermute_rows(w, self._heads[proj])
    _release_pages(self._reader)
    return w

  def __iter__(self) -> Iterator[str]:
    return iter(self._by_name)

  def __len__(self) -> int:
    return len(self._by_name)

  def __contains__(self, name: object) -> bool:
    return name in self._by_name


def _release_pages(reader) -> None:
  """Drop the file pages the reader's memory map holds (they are read again if touched): the
  map would otherwise keep every tensor read so far in this process's resident memory."""
  mm = getattr(getattr(reader, "data", None), "_mmap", None)
  if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
    mm.madvise(mmap.MADV_DONTNEED)


def load_gguf(path: str | Path, reader=None) -> tuple[dict[str, Any], GGUFTensors]:
  """(HF-style config dict, lazy {HF tensor name: float32 array [out, in]}) of a GGUF file (pass
  an open `gguf.GGUFReader` to avoid parsing the file twice). A tensor with no place in the
  architecture is an error that names it. The tensors are read when the weights are filled
  (`models/load.py` shows that progress)."""
  from gguf import GGUFReader
  from gguf.quants import dequantize
  reader = reader if reader is not None else GGUFReader(str(path))
  meta = {k: field_value(reader, k) for k in reader.fields if not k.startswith("tokenizer.ggml.t")
          and not k.startswith("tokenizer.ggml.merges") and not k.startswith("tokenizer.ggml.scores")}
  arch = meta["general.architecture"]
  unplaced = [t.name for t in reader.tensors if hf_name(t.name, arch) is None and t.name != "rope_freqs.weight"]
  if unplaced:
    raise ValueError(f"{Path(path).name}: GGUF tensors with no place in a {arch} model: {unplaced[:8]}"
                     f"{' ...' if len(unplaced) > 8 else ''}")
  by_name = {t.name: t for t in reader.tensors}
  if "token_embd.weight" not in by_name:
    raise ValueError(f"{Path(path).name}: no token_embd.weight tensor")
  n_vocab = int(by_name["token_embd.weight"].shape.tolist()[-1])              # GGUF shapes are [in, out]
  hf = hf_config_from_metadata(meta, n_vocab)
  if "rope_freqs.weight" in by_name:
    t = by_name["rope_freqs.weight"]
    factors = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(-1)
    if factors.size != hf["head_dim"] // 2:
      raise ValueError(f"{Path(path).name}: rope_freqs.weight has {factors.size} factors, expected "
                       f"head_dim / 2 = {hf['head_dim'] // 2}")
    hf["rope_scaling"] = {"rope_type": "freq_factors", "factors": [float(f) for f in factors]}
  hf["tie_word_embeddings"] = "output.weight" not in by_name
  tensors = GGUFTensors(reader, arch, hf["num_attention_heads"], hf["num_key_value_heads"])
  _release_pages(reader)
  return hf, tensors
