"""A decoder layer's decode / verification step through the fused kernels, and a `forward` using it.

`fused_block` computes what `decoder.Block` computes (same parameters, same KV cache write, same
attention dispatch) in four kernel launches besides attention and the cache write
(`specjax.kernels.fused_decode`): RMSNorm + q/k/v projection + rotary; o_proj + residual add;
RMSNorm + gate/up projection + act(gate) * up; down projection + residual add. A decode step at
small batch is bound by launches, so fewer of them is the point. The kernels read the layers'
[out, in] kernels as they are stored.

It serves steps of at most `fused_decode.MAX_ROWS` rows (batch x new tokens: decode and chain /
tree verification) of configs `unsupported` accepts; anything else (prefill, sandwich norms, the
batch-invariant mode, head sizes the kernel does not tile) runs `decoder.forward` unchanged.

Switch: `forward(..., fused=None)` and `FusedDecoderTarget` read SPECJAX_FUSED_DECODE ("1": fused
layers; default off), and so does `engine.generation.target_of`, which returns `FusedDecoderTarget()`
then. Off by default: where it was measured, these kernels ran slower than XLA's own fusions of the
same layer (experiments/README.md, "How fast is plain decoding?").
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Sequence

import jax
import jax.numpy as jnp

from specjax.kernels import fused_decode, verify_attention
from specjax.models import decoder
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, check_capacity
from specjax.models.layers import rope_inv_freq, split_qkv

FUSED_ENV = "SPECJAX_FUSED_DECODE"       # "1": decode / verification steps through the fused layer


def enabled() -> bool:
  """SPECJAX_FUSED_DECODE=1 (default off)."""
  return os.environ.get(FUSED_ENV, "0") == "1"


def unsupported(cfg) -> str | None:
  """Why the fused layer cannot run `cfg` (None: it can)."""
  if not isinstance(cfg, ModelConfig):
    return f"{type(cfg).__name__} is not an attention-only decoder"
  if cfg.invariant:
    return "the batch-invariant mode runs its own kernels"
  if cfg.sandwich_norm:
    return "sandwich norms (gemma3) norm the attention output before the residual add"
  if cfg.head_dim & (cfg.head_dim - 1) or cfg.head_dim < 32:
    return f"head_dim {cfg.head_dim} is not a power of two >= 32"
  if cfg.activation not in fused_decode.ACTIVATIONS:
    return f"activation {cfg.activation!r}"
  return None


def serves(cfg, rows: int, fused: bool | None = None) -> bool:
  """Whether a step of `rows` (batch x new tokens) runs the fused layer: asked for (`fused`, else
  the environment), a supported config, and at most MAX_ROWS rows."""
  wanted = enabled() if fused is None else fused
  return wanted and unsupported(cfg) is None and rows <= fused_decode.MAX_ROWS


def rope_tables(positions: jax.Array, head_dim: int, theta: float, scaling: tuple = ()):
  """cos, sin [B*T, D/2] float32 of the rotary angles at positions [B, T], as `layers.rope`
  computes them; built once per step and shared by every layer of the same theta."""
  inv_freq = jnp.asarray(rope_inv_freq(head_dim, theta, scaling))                # [D/2]
  angles = positions.reshape(-1).astype(jnp.float32)[:, None] * inv_freq         # [B*T, D/2]
  return jnp.cos(angles), jnp.sin(angles)


def fused_block(block: decoder.Block, x: jax.Array, positions: jax.Array, write_kv, masks: dict,
                tables: dict, *, interpret: bool | None = None):
  """`block(x, positions, write_kv, masks)` through the fused kernels.

  x [B, T, d_model] float32; positions [B, T]; write_kv(k_new, v_new) -> (k_all, v_all) as in
  `decoder.Transformer`; masks from `decoder.attention_masks`; tables: (theta, scaling) ->
  `rope_tables` (filled here when missing). -> (x [B, T, d_model] float32, (k_all, v_all)).
  """
  b, t, dm = x.shape
  attn, mlp = block.self_attn, block.mlp
  h, kvh, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
  key = (attn.theta, attn.rope_scaling)
  if key not in tables:
    tables[key] = rope_tables(positions, hd, *key)
  cos, sin = tables[key]                                                          # [M, D/2] each
  rows = x.reshape(b * t, dm)                                                     # [M, d_model]
  ln1, ln2 = block.input_layernorm, block.post_attention_layernorm
  param = lambda p: None if p is None else p[...]
  qk = {}
  if attn.q_norm is not None:
    qk = dict(q_norm=attn.q_norm.weight[...], k_norm=attn.k_norm.weight[...], qk_eps=attn.q_norm.eps,
              qk_offset=attn.q_norm.offset)
  qkv = fused_decode.norm_qkv_rope(
      rows, ln1.weight[...], attn.qkv_proj.kernel[...], cos, sin, eps=ln1.eps, offset=ln1.offset,
      n_heads=h, n_kv_heads=kvh, head_dim=hd, bias=param(attn.qkv_proj.bias), interpret=interpret,
      **qk)                                                                       # [M, (H+2KVH)*D]
  q, k, v = split_qkv(qkv.reshape(b, t, -1), h, kvh, hd)                          # [B, T, H | KVH, D]
  k_all, v_all = write_kv(k, v)                                                   # [B, S, KVH, D]
  kind = "sliding" if block.sliding else "full"
  ragged = masks.get("ragged", {}).get(kind)
  out = verify_attention.attention(q, k_all, v_all, masks[kind], attn.scale, ragged)   # [B, T, H, D] f32
  rows = fused_decode.matmul_residual(out.reshape(b * t, h * hd), attn.o_proj.kernel[...], rows,
                                      param(attn.o_proj.bias), interpret=interpret)   # [M, d_model]
  act = fused_decode.norm_gate_up(rows, ln2.weight[...], mlp.gate_up_proj.kernel[...], eps=ln2.eps,
                                  offset=ln2.offset, activation=mlp.activation, interpret=interpret)   # [M, F]
  rows = fused_decode.matmul_residual(act, mlp.down_proj.kernel[...], rows, interpret=interpret)
  return rows.reshape(b, t, dm), (k_all, v_all)


def forward(params, cfg: ModelConfig, tokens, cache: KVCache, *, positions=None, n_new=None, attn_mask=None,
            taps: Sequence[int] = (), last_only: bool = False, fused: bool | None = None,
            interpret: bool | None = None):
  """`decoder.forward` (same arguments and results) with every layer through `fused_block` when
  `serves(cfg, B*T, fused)`; otherwise `decoder.forward` itself. `fused` None: SPECJAX_FUSED_DECODE."""
  b, t = tokens.shape
  if not serves(cfg, b * t, fused):
    return decoder.forward(params, cfg, tokens, cache, positions=positions, n_new=n_new, attn_mask=attn_mask,
                           taps=taps, last_only=last_only)
  check_capacity(cache.lengths, t, cache.capacity)
  if positions is None:
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  n_new = jnp.full((b,), t, jnp.int32) if n_new is None else jnp.asarray(n_new, jnp.int32)
  masks = decoder.attention_masks(cfg, cache.lengths, positions, cache.capacity, attn_mask)
  model = decoder.model_of(params, cfg)
  x = model.embed(tokens)                                                         # [B, T, d_model] f32
  tables, new_k, new_v, tapped = {}, [], [], []
  for i, block in enumerate(model.layers):
    x, (k, v) = fused_block(block, x, positions, functools.partial(cache.write, i), masks, tables,
                            interpret=interpret)
    new_k.append(k)
    new_v.append(v)
    if i in taps:
      tapped.append(x)
  prenorm = x
  if last_only:   # the last valid token of each sequence
    x = jnp.take_along_axis(x, (n_new - 1)[:, None, None], axis=1)               # [B, 1, d_model]
  logits = model.logits(x)                                                        # [B, T | 1, V] f32
  new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths + n_new)
  return logits, {"prenorm": prenorm, "layers": tuple(tapped)}, new_cache


@dataclasses.dataclass(frozen=True)
class FusedDecoderTarget(decoder.DecoderTarget):
  """`decoder.DecoderTarget` whose decode and verification steps run `forward` above (prefill and
  unsupported configs fall through to the XLA layer). `fused` None: SPECJAX_FUSED_DECODE."""

  fused: bool | None = None

  def forward(self, params, cfg: ModelConfig, tokens, state: KVCache, **kw):
    return forward(params, cfg, tokens, state, fused=self.fused, **kw)

  def verify(self, params, cfg: ModelConfig, tokens, state: KVCache, *, taps=()):
    return forward(params, cfg, tokens, state, taps=taps, fused=self.fused) + (None,)
