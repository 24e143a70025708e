"""The hybrid family's static configuration (`HybridConfig`) and how it is read from an HF
`config.json` (Qwen3.5: "qwen3_5_text", or "qwen3_5" with a text_config). The model:
`specjax.models.hybrid`; its weights: `specjax.models.hybrid_weights`."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

HYBRID_ARCHS = ("qwen3_5",)
HF_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")


@dataclasses.dataclass(frozen=True)
class HybridConfig:
  arch: str                       # "qwen3_5"
  vocab_size: int
  d_model: int
  n_layers: int
  layer_types: tuple[str, ...]    # "linear" | "full", one per layer
  n_heads: int                    # attention layers
  n_kv_heads: int
  head_dim: int
  ffn_dim: int
  lin_k_heads: int                # gated DeltaNet: query/key heads
  lin_v_heads: int                # value heads (a multiple of lin_k_heads)
  lin_k_dim: int
  lin_v_dim: int
  conv_kernel: int = 4
  rope_theta: float = 10_000_000.0
  rotary_dim: int | None = None   # rotated dims per head (partial rotary); default head_dim
  norm_eps: float = 1e-6
  attn_bias: bool = False
  tie_embeddings: bool = False
  activation: str = "silu"
  chunk_size: int = 64            # chunk of the parallel DeltaNet form (prefill)
  bos_id: int | None = None
  eos_id: int | None = None
  sliding_window: None = None     # no sliding layers (read by `decoder.attention_masks`)

  def __post_init__(self):
    if self.arch not in HYBRID_ARCHS:
      raise ValueError(f"unknown hybrid arch {self.arch!r}; specjax runs {HYBRID_ARCHS}")
    if len(self.layer_types) != self.n_layers or set(self.layer_types) - {"linear", "full"}:
      raise ValueError(f"layer_types must be {self.n_layers} of 'linear' / 'full', got {self.layer_types}")
    if self.n_heads % self.n_kv_heads or self.lin_v_heads % self.lin_k_heads:
      raise ValueError("attention heads / DeltaNet value heads must be multiples of their KV / key heads")
    if self.rotary_dim is None:
      object.__setattr__(self, "rotary_dim", self.head_dim)
    if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
      raise ValueError(f"rotary_dim must be even and in (0, head_dim], got {self.rotary_dim}")

  @property
  def scale(self) -> float:
    return self.head_dim ** -0.5

  @property
  def norm_offset(self) -> bool:
    """RMSNorm weights are applied as (1 + w) (Gemma-style), as `ModelConfig.norm_offset` says."""
    return True

  @property
  def attn_layers(self) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(self.layer_types) if t == "full")

  @property
  def linear_layers(self) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(self.layer_types) if t == "linear")

  @property
  def conv_dim(self) -> int:
    return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

  def replace(self, **kw) -> "HybridConfig":
    return dataclasses.replace(self, **kw)


def is_hybrid_hf_config(hf: Mapping[str, Any]) -> bool:
  return hf.get("model_type") in HF_MODEL_TYPES


def hybrid_config_from_hf(hf: Mapping[str, Any]) -> HybridConfig:
  """HybridConfig from an HF `config.json` dict ("qwen3_5_text", or "qwen3_5" with a text_config)."""
  top = hf
  if hf.get("model_type") == "qwen3_5" and "text_config" in hf:
    hf = {**hf["text_config"]}
  elif hf.get("model_type") not in HF_MODEL_TYPES:
    raise ValueError(f"model_type {hf.get('model_type')!r} is not a hybrid specjax runs {HF_MODEL_TYPES}")
  if hf.get("hidden_act", "silu") != "silu":
    raise NotImplementedError(f"hidden_act {hf['hidden_act']!r} is not supported (Qwen3.5 uses silu)")
  rope_p = hf.get("rope_parameters") or {}
  if rope_p.get("rope_type", "default") != "default":
    raise NotImplementedError(f"rope type {rope_p['rope_type']!r} is not supported yet")
  head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
  factor = float(rope_p.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
  n_layers = hf["num_hidden_layers"]
  types = hf.get("layer_types") or ["linear_attention" if (i + 1) % hf.get("full_attention_interval", 4)
                                    else "full_attention" for i in range(n_layers)]
  tie = hf.get("tie_word_embeddings", top.get("tie_word_embeddings", False))
  eos = hf.get("eos_token_id", top.get("eos_token_id"))
  return HybridConfig(
      arch="qwen3_5", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=n_layers,
      layer_types=tuple("linear" if t == "linear_attention" else "full" for t in types[:n_layers]),
      n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
      head_dim=head_dim, ffn_dim=hf["intermediate_size"],
      lin_k_heads=hf["linear_num_key_heads"], lin_v_heads=hf["linear_num_value_heads"],
      lin_k_dim=hf["linear_key_head_dim"], lin_v_dim=hf["linear_value_head_dim"],
      conv_kernel=hf.get("linear_conv_kernel_dim", 4),
      rope_theta=float(rope_p.get("rope_theta", hf.get("rope_theta", 10_000_000.0))),
      rotary_dim=int(head_dim * factor) // 2 * 2, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      attn_bias=bool(hf.get("attention_bias", False)), tie_embeddings=bool(tie),
      bos_id=hf.get("bos_token_id", top.get("bos_token_id")), eos_id=eos[0] if isinstance(eos, (list, tuple)) else eos)
