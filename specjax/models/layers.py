"""Building blocks of the decoder families: RMSNorm, rotary embeddings, attention, MLP.

Flax NNX modules define the parameters; their `__call__`s are pure functions of inputs and the
KV arrays they are handed (caches are never module state).

`invariant=True` (a static attribute; the target's `ModelConfig.invariant`) runs the linear
layers, the norms and attention through the batch-invariant kernels of `specjax.kernels`: a row's
result then does not depend on how many rows (tokens) the call has, so a one-token decode and a
K+1-token verification give a position bitwise equal logits. The element-wise parts (rotary
embedding, activations, residual adds) are row-wise in XLA either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.kernels import invariant_attention, invariant_matmul, invariant_rmsnorm, verify_attention

NEG_INF = verify_attention.NEG_INF

# A one-row product (a batch-1 decode step) whose weight has at least this many elements runs as a
# two-row GEMM. XLA's GPU compiler rewrites a one-row product as a broadcast multiply and a
# reduction. Weights are stored [out, in] so that reduction runs along each weight row's contiguous
# memory, which XLA fuses with the multiply (across rows it writes the multiply's whole float32
# product first); for wide matrices a GEMM with a zero second row still reads the weights faster
# than the fused reduction (experiments/README.md, "How fast is plain decoding?").
TWO_ROW_MIN_ELEMENTS = 1 << 21


def row_product(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., in] @ w [out, in].T -> [..., out] float32 (x rounded to w's dtype). With one row in
  all and w of TWO_ROW_MIN_ELEMENTS or more: the row and a zero row as one GEMM, row 0 kept (values
  are the product's; the optimization barriers keep the simplifier from folding the zero row away)."""
  if int(np.prod(x.shape[:-1])) != 1 or w.size < TWO_ROW_MIN_ELEMENTS:
    return jnp.einsum("...i,oi->...o", x.astype(w.dtype), w, preferred_element_type=jnp.float32)
  rows = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)]).astype(w.dtype)   # [2, in]
  y = jnp.einsum("mi,oi->mo", jax.lax.optimization_barrier(rows), w, preferred_element_type=jnp.float32)
  return jax.lax.optimization_barrier(y)[0].reshape(*x.shape[:-1], w.shape[0])                    # [..., out]


class Linear(nnx.Module):
  """y = x @ kernel.T (+ bias). kernel is [out, in], as HF and PyTorch store it (a one-row product
  then reduces along contiguous memory: `TWO_ROW_MIN_ELEMENTS`).

  The input is rounded to the weight dtype, the product accumulates and is returned in float32:
  with bf16 weights the residual stream stays float32, so a K+1-token verification and a
  one-token decode round identically far more often (fewer greedy divergences from float ties).

  `fused`: for a projection fused from several HF ones, how its output axis is made of them
  (`qkv_layout`, `gate_up_layout`); loaders read it to place the parts' rows (`weights.fuse_rows`).
  """

  def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs, invariant: bool = False,
               fused: tuple[tuple[int, ...], int] | None = None):
    std = d_in ** -0.5
    kernel = jax.random.normal(rngs.params(), (d_in, d_out), jnp.float32)
    if fused is not None:     # drawn as the parts side by side, then placed: a seed gives one function
      kernel = kernel[:, fused_order(fused)]
    self.kernel = nnx.Param(kernel.T.astype(dtype) * std)                          # [out, in]
    self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None
    self.invariant = invariant
    self.fused = fused

  def __call__(self, x: jax.Array) -> jax.Array:
    w = self.kernel[...]
    if self.invariant:
      y = invariant_matmul.pallas_matmul(x, w, transposed=True)                   # [..., out] float32
    else:
      y = row_product(x, w)                                                       # [..., out] float32
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    return y


class RMSNorm(nnx.Module):
  """RMSNorm in float32; `offset` gives Gemma's (1 + w) weight."""

  def __init__(self, dim: int, eps: float, *, offset: bool, dtype, invariant: bool = False):
    self.weight = nnx.Param(jnp.zeros((dim,), dtype) if offset else jnp.ones((dim,), dtype))
    self.eps = eps
    self.offset = offset
    self.invariant = invariant

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.invariant:
      return invariant_rmsnorm.rms_norm(x, self.weight[...], self.eps, offset=self.offset)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    w = self.weight[...].astype(jnp.float32)
    if self.offset:
      w = 1.0 + w
    return (xf * w).astype(x.dtype)


def rope_inv_freq(d: int, theta: float, scaling: tuple = ()) -> np.ndarray:
  """Rotary frequencies [D/2] (float32, static): theta^(-2i/D), then the checkpoint's scaling.
  "linear": every frequency / factor. "llama3": wavelengths longer than original/low_freq_factor
  are slowed by `factor`, shorter than original/high_freq_factor kept, and those between blend the
  two linearly in original/wavelength. "freq_factors": frequency i / factor i (llama.cpp's
  rope_freqs, which stores the llama3 rule's divisors)."""
  inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
  if scaling and scaling[0] == "linear":
    inv_freq = inv_freq / scaling[1]
  elif scaling and scaling[0] == "freq_factors":
    inv_freq = inv_freq / np.asarray(scaling[1:], np.float64)
  elif scaling and scaling[0] == "llama3":
    _, factor, low, high, original = scaling
    wavelen = 2 * np.pi / inv_freq
    blend = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)       # 0: slowed, 1: kept
    inv_freq = (1 - blend) * inv_freq / factor + blend * inv_freq
  return inv_freq.astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, theta: float, scaling: tuple = ()) -> jax.Array:
  """Rotate-half rotary embedding. x [B, T, H, D], positions [B, T] int."""
  d = x.shape[-1]
  inv_freq = jnp.asarray(rope_inv_freq(d, theta, scaling))                       # [D/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq                   # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]                                           # [B, T, 1, D/2]
  sin = jnp.sin(angles)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


attend = verify_attention.attend_reference   # XLA attention over a dense [B, T, S] mask


# Fused projections. A fused output axis is its HF parts' outputs interleaved in groups: group g
# holds the g-th of `groups` equal slices of every part, in order (`weights.fuse_rows` writes the
# loaded rows so). q / k / v are grouped per KV head (for KV head g: its H / KVH query heads, then
# K_g, then V_g) and gate / up per MLP unit (gate_j, up_j). A contiguous split of the output axis
# over the mesh's "model" axis (`parallel.partition`, whole groups per device) then gives every
# device matching slices of every part, the query heads of the K / V heads it holds and the gate
# and up columns of the same units, so attention and the gated product run where the weights are.
# One order whatever the mesh; on one device a permutation of the output columns (each column the
# same dot product), so results are those of [Q | K | V] and [gate | up].


def grouped_layout(parts: tuple[int, ...], groups: int) -> tuple[tuple[int, ...], int]:
  """A fused projection's layout: (output size of each HF part, groups), checked."""
  if any(p % groups for p in parts):
    raise ValueError(f"fused parts of sizes {parts} do not split into {groups} groups")
  return tuple(parts), groups


def qkv_layout(n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[tuple[int, ...], int]:
  """q / k / v of a (grouped-query) attention, grouped per KV head."""
  return grouped_layout((n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim), n_kv_heads)


def gate_up_layout(ffn_dim: int) -> tuple[tuple[int, ...], int]:
  """gate / up of a gated MLP, interleaved per unit."""
  return grouped_layout((ffn_dim, ffn_dim), ffn_dim)


def fused_order(layout: tuple[tuple[int, ...], int]) -> np.ndarray:
  """For each fused output column, its index among the HF parts' outputs laid side by side
  ([Q | K | V], [gate | up]): fused = side_by_side[..., fused_order(layout)]."""
  sizes, groups = layout
  side = np.split(np.arange(sum(sizes)), np.cumsum(sizes)[:-1])
  return np.concatenate([p.reshape(groups, -1) for p in side], axis=1).reshape(-1)


def split_qkv(qkv: jax.Array, n_heads: int, n_kv_heads: int, head_dim: int):
  """A fused q / k / v projection's output [B, T, (H+2KVH)*D] (`qkv_layout`) -> q [B, T, H, D],
  k, v [B, T, KVH, D]; query head i belongs to KV head i // (H / KVH), as in HF's GQA."""
  b, t = qkv.shape[:2]
  g = n_heads // n_kv_heads
  qkv = qkv.reshape(b, t, n_kv_heads, g + 2, head_dim)                           # [B, T, KVH, G+2, D]
  q = qkv[:, :, :, :g].reshape(b, t, n_heads, head_dim)                          # [B, T, H, D]
  return q, qkv[:, :, :, g], qkv[:, :, :, g + 1]                                 # k, v [B, T, KVH, D]


def split_gate_up(gu: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A fused gate / up projection's output [..., 2F] (`gate_up_layout`) -> gate, up [..., F]."""
  gu = gu.reshape(*gu.shape[:-1], -1, 2)                                         # [..., F, 2]
  return gu[..., 0], gu[..., 1]


class Attention(nnx.Module):
  def __init__(self, cfg, *, sliding: bool, dtype, rngs: nnx.Rngs, invariant: bool = False):
    h, kvh, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    # Q, K and V projections as one matrix [d_model, (H + 2 KVH) * D]: one GEMM launch instead of
    # three (decode at small batch is bound by launches, not bytes), columns grouped per KV head.
    self.qkv_proj = Linear(cfg.d_model, (h + 2 * kvh) * d, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs,
                           invariant=invariant, fused=qkv_layout(h, kvh, d))
    self.o_proj = Linear(h * d, cfg.d_model, bias=cfg.o_bias, dtype=dtype, rngs=rngs, invariant=invariant)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(d, cfg.norm_eps, offset=cfg.norm_offset, dtype=dtype, invariant=invariant)
      self.k_norm = RMSNorm(d, cfg.norm_eps, offset=cfg.norm_offset, dtype=dtype, invariant=invariant)
    else:
      self.q_norm = self.k_norm = None
    self.n_heads, self.n_kv_heads, self.head_dim = h, kvh, d
    self.theta = cfg.rope_local_theta if (sliding and cfg.rope_local_theta) else cfg.rope_theta
    self.rope_scaling = () if (sliding and cfg.rope_local_theta) else cfg.rope_scaling
    self.scale = cfg.scale
    self.window = cfg.sliding_window if sliding else None
    self.invariant = invariant

  def __call__(self, x, positions, write_kv, mask, ragged=None, causal=False):
    """x [B, T, d_model]; positions [B, T]; write_kv(k_new, v_new) -> (k_all, v_all); mask [B, T, S];
    ragged: the same mask as lengths + a mask among the new tokens, when it is one (the kernel's input).
    Invariant attention reads `ragged` (the full-attention one; the window is applied in the kernel)
    and `causal` (the new tokens are a chain at their own slots) instead of `mask`."""
    b, t, _ = x.shape
    qkv = self.qkv_proj(x)                                                        # [B, T, (H+2KVH)*D]
    q, k, v = split_qkv(qkv, self.n_heads, self.n_kv_heads, self.head_dim)        # [B, T, H | KVH, D]
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = rope(q, positions, self.theta, self.rope_scaling), rope(k, positions, self.theta, self.rope_scaling)
    k_all, v_all = write_kv(k, v)                                                 # [B, S, KVH, D]
    if self.invariant:
      out = invariant_attention.invariant_attention(
          q, k_all, v_all, ragged.lengths, positions, self.scale,
          new_mask=None if causal else ragged.new_mask, window=self.window)   # [B, T, H, D]
    else:
      out = verify_attention.attention(q, k_all, v_all, mask, self.scale, ragged)   # [B, T, H, D]
    return self.o_proj(out.reshape(b, t, -1)), (k_all, v_all)


class MLP(nnx.Module):
  """Gated MLP: down(act(gate(x)) * up(x))."""

  def __init__(self, cfg, *, dtype, rngs: nnx.Rngs, invariant: bool = False):
    self.gate_up_proj = Linear(cfg.d_model, 2 * cfg.ffn_dim, bias=False, dtype=dtype, rngs=rngs,
                               invariant=invariant, fused=gate_up_layout(cfg.ffn_dim))   # gate / up per unit
    self.down_proj = Linear(cfg.ffn_dim, cfg.d_model, bias=False, dtype=dtype, rngs=rngs, invariant=invariant)
    self.activation = cfg.activation

  def __call__(self, x):
    g, u = split_gate_up(self.gate_up_proj(x))                                    # [B, T, F] each
    g = jax.nn.silu(g) if self.activation == "silu" else jax.nn.gelu(g, approximate=True)
    return self.down_proj(g * u)
