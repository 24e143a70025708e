"""Model configuration: one hashable, static dataclass for every decoder family specjax runs.

Built from an HF `config.json` dict (`from_hf_config`) or from GGUF metadata (io/gguf.py turns
that into the same HF-style dict first), so both loaders share one path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  arch: str                       # "llama" | "qwen2" | "qwen3" | "mistral" | "gemma3"
  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 10000.0
  rope_local_theta: float | None = None     # gemma3 sliding layers
  rope_scaling: tuple = ()                  # () or ("llama3", factor, low_freq_factor, high_freq_factor,
                                            # original_max_positions), ("linear", factor) or
                                            # ("freq_factors", *divisors): full layers
  sliding_window: int | None = None
  layer_types: tuple[str, ...] = ()         # "full" | "sliding", one per layer
  norm_eps: float = 1e-5
  qkv_bias: bool = False
  o_bias: bool = False                      # llama attention_bias also biases o_proj
  tie_embeddings: bool = False
  qk_norm: bool = False                     # gemma3
  sandwich_norm: bool = False               # gemma3: post-attention / post-ffn norms
  embed_scale: bool = False                 # gemma3: embeddings times sqrt(d_model)
  norm_offset: bool = False                 # gemma3: RMSNorm weight is (1 + w)
  activation: str = "silu"                  # "silu" | "gelu_tanh"
  query_scale: float | None = None          # default head_dim ** -0.5
  bos_id: int | None = None
  eos_id: int | None = None
  invariant: bool = False                   # batch-invariant forward: a row's logits do not depend on the
                                            # number of rows (specjax/kernels/invariant_*; `api.load`)

  def __post_init__(self):
    if self.arch not in ARCHS:
      raise ValueError(f"unknown arch {self.arch!r}; specjax runs {ARCHS}")
    if not self.layer_types:
      object.__setattr__(self, "layer_types", ("full",) * self.n_layers)
    if len(self.layer_types) != self.n_layers:
      raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

  @property
  def scale(self) -> float:
    return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

  def replace(self, **kw) -> "ModelConfig":
    if "n_layers" in kw and "layer_types" not in kw:
      kw["layer_types"] = tuple(self.layer_types[i % len(self.layer_types)] for i in range(kw["n_layers"]))
    return dataclasses.replace(self, **kw)


def _gemma3_layer_types(hf: dict[str, Any], n_layers: int) -> tuple[str, ...]:
  if "layer_types" in hf and hf["layer_types"]:
    return tuple("sliding" if t == "sliding_attention" else "full" for t in hf["layer_types"])
  pattern = hf.get("sliding_window_pattern", 6)
  return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers))


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
  """ModelConfig from an HF `config.json` dict (llama, qwen2, gemma3 / gemma3_text)."""
  model_type = hf.get("model_type", "")
  if model_type in ("gemma3", "gemma3_text") and "text_config" in hf:
    hf = {**hf["text_config"], "model_type": "gemma3_text"}
    model_type = "gemma3_text"
  d_model = hf["hidden_size"]
  n_heads = hf["num_attention_heads"]
  theta, local_theta, scaling = _rope_thetas(hf)
  common = dict(
      vocab_size=hf["vocab_size"], d_model=d_model, n_layers=hf["num_hidden_layers"],
      n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads", n_heads),
      head_dim=hf.get("head_dim") or d_model // n_heads, ffn_dim=hf["intermediate_size"],
      rope_theta=theta, rope_scaling=scaling, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      bos_id=hf.get("bos_token_id"), eos_id=_first(hf.get("eos_token_id")))
  if model_type == "llama":
    if hf.get("mlp_bias"):
      raise NotImplementedError("llama mlp_bias=True is not supported")
    return ModelConfig(arch="llama", qkv_bias=bool(hf.get("attention_bias", False)),
                       o_bias=bool(hf.get("attention_bias", False)),
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **common)
  if model_type == "qwen2":
    return ModelConfig(arch="qwen2", qkv_bias=True,
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **common)
  if model_type == "qwen3":     # QK-norm (plain RMSNorm over head_dim), no QKV bias by default
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
      raise NotImplementedError("qwen3 use_sliding_window=True is not supported")
    return ModelConfig(arch="qwen3", qk_norm=True, qkv_bias=bool(hf.get("attention_bias", False)),
                       o_bias=bool(hf.get("attention_bias", False)),
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **common)
  if model_type == "mistral":   # llama layout; a sliding window (v0.1) makes every layer sliding
    window = hf.get("sliding_window")
    return ModelConfig(arch="mistral", sliding_window=window,
                       layer_types=("sliding",) * common["n_layers"] if window else (),
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **common)
  if model_type in ("gemma3_text", "gemma3"):
    n_layers = common["n_layers"]
    return ModelConfig(
        arch="gemma3", tie_embeddings=True, qk_norm=True, sandwich_norm=True, embed_scale=True,
        norm_offset=True, activation="gelu_tanh",
        rope_local_theta=local_theta,
        sliding_window=hf.get("sliding_window"), layer_types=_gemma3_layer_types(hf, n_layers),
        query_scale=float(hf.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5, **common)
  raise NotImplementedError(f"unsupported model_type {model_type!r}; specjax runs llama, qwen2, qwen3, mistral, gemma3")


def _rope_thetas(hf: dict[str, Any]) -> tuple[float, float, tuple]:
  """(global base, local base, scaling of the global one) from either config style: transformers 4
  (`rope_theta`, `rope_local_base_freq`, `rope_scaling`) or transformers 5 (`rope_parameters`, per
  layer type). Scaling: () , ("linear", factor), ("llama3", factor, low, high, original positions) or
  ("freq_factors", f_0, .., f_{D/2-1}) (a divisor per frequency, as GGUF files store Llama-3.x's)."""
  params = hf.get("rope_parameters") or {}
  per_type = params if "full_attention" in params else {"full_attention": params or hf.get("rope_scaling") or {}}
  scaling = ()
  for layer_type, kind in per_type.items():
    kind = kind or {}
    rope_type = kind.get("rope_type", kind.get("type", "default"))
    if rope_type in ("default", None):
      continue
    if layer_type != "full_attention":
      raise NotImplementedError(f"rope type {rope_type!r} on {layer_type} layers is not supported yet")
    if rope_type == "linear":
      scaling = ("linear", float(kind["factor"]))
    elif rope_type == "freq_factors":     # a GGUF's rope_freqs.weight (specjax.io.gguf)
      scaling = ("freq_factors", *(float(f) for f in kind["factors"]))
    elif rope_type == "llama3":
      scaling = ("llama3", float(kind["factor"]), float(kind["low_freq_factor"]), float(kind["high_freq_factor"]),
                 int(kind["original_max_position_embeddings"]))
    else:
      raise NotImplementedError(f"rope type {rope_type!r} is not supported yet (default, linear, llama3 are)")
  theta = float(per_type["full_attention"].get("rope_theta", hf.get("rope_theta", 10000.0)))
  local = float(per_type.get("sliding_attention", {}).get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
  return theta, local, scaling


def _first(x):
  return x[0] if isinstance(x, (list, tuple)) else x
