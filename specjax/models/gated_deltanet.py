"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention): the recurrent layer of the hybrid family.

Per value head the layer keeps a matrix state S [Dk, Dv] and, per token t (all in float32):

    S   <- exp(g_t) * S                              decay, g_t <= 0
    u_t  = beta_t * (v_t - S^T k_t)                  delta rule: write only what S does not predict
    S   <- S + k_t u_t^T
    o_t  = S^T q_t

q and k are L2-normalised (q also scaled by Dk^-1/2). Ahead of it sits a depthwise causal
convolution (kernel K, SiLU) over the [q | k | v] channels, whose state is the last K-1 inputs.

Two forms of the same map:
- `gated_delta_recurrent`: the loop above, one token at a time (one-token decode).
- `gated_delta_chunked`: the parallel form (prefill, K+1-token verification). Within a chunk of C
  tokens the u_t solve one unit-lower-triangular system (I + L) U = beta V - beta exp(G) K S0, with
  L_ij = beta_i (k_i . k_j) exp(G_i - G_j) for j < i and G the cumulative log decay; outputs and
  the end-of-chunk state are then matrix products. Chunks are scanned in sequence.
Both can return the state after every position (`per_step`), which is what speculative
verification keeps in the `per_step` rollback mode.

Padding (positions past `n_new`) gets beta = 0 and g = 0: an identity update, so the state after
the whole block is the state after the last valid token, with no gather.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.layers import Linear, RMSNorm

HIGHEST = jax.lax.Precision.HIGHEST   # the recurrent state accumulates: no TF32 on GPUs


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / sqrt(sum x^2 + eps) over the last axis (the FLA / transformers convention)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# ----------------------------------------------------------------------------------------------
# depthwise causal convolution with a carried state


def causal_conv(x: jax.Array, conv_state: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Depthwise causal conv + SiLU continuing from `conv_state`.

  x [B, T, C] float32; conv_state [B, K-1, C] (the K-1 previous inputs); weight [C, K].
  Returns (out [B, T, C], window [B, K-1+T, C] = state then inputs, for the new state(s)).
  """
  t = x.shape[1]
  k = weight.shape[1]
  window = jnp.concatenate([conv_state.astype(jnp.float32), x], axis=1)          # [B, K-1+T, C]
  w = weight.astype(jnp.float32)
  out = sum(window[:, i:i + t] * w[:, i] for i in range(k))                       # [B, T, C]
  return jax.nn.silu(out), window


def conv_state_after(window: jax.Array, n_new: jax.Array, k1: int) -> jax.Array:
  """The conv state after `n_new` [B] of the new tokens: window rows n_new .. n_new+K-2. -> [B, K-1, C]"""
  rows = n_new[:, None] + jnp.arange(k1)[None, :]                                 # [B, K-1]
  return jnp.take_along_axis(window, rows[:, :, None], axis=1)


def conv_states_per_step(window: jax.Array, t: int, k1: int) -> jax.Array:
  """The conv state after each of the T new tokens. window [B, K-1+T, C] -> [B, T, K-1, C]"""
  rows = jnp.arange(1, t + 1)[:, None] + jnp.arange(k1)[None, :]                  # [T, K-1]
  return window[:, rows]


# ----------------------------------------------------------------------------------------------
# the gated delta rule, recurrent and chunked


def gated_delta_recurrent(q, k, v, g, beta, state, *, per_step: bool = False):
  """Token-by-token gated delta rule.

  q, k [B, T, H, Dk] (normalised, scaled, one per value head); v [B, T, H, Dv]; g, beta [B, T, H];
  state [B, H, Dk, Dv] float32. Returns (o [B, T, H, Dv], final state, per-step states
  [B, T, H, Dk, Dv] or None).
  """
  def step(s, x):
    q_t, k_t, v_t, g_t, b_t = x                                                   # [B, H, ...]
    s = s * jnp.exp(g_t)[..., None, None]
    pred = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=HIGHEST)                 # S^T k
    u = (v_t - pred) * b_t[..., None]                                             # [B, H, Dv]
    s = s + k_t[..., :, None] * u[..., None, :]
    o = jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=HIGHEST)                    # [B, H, Dv]
    return s, (o, s if per_step else None)

  if q.shape[1] == 1:   # one-token decode: no loop
    state, (o, s) = step(state, tuple(a[:, 0] for a in (q, k, v, g, beta)))
    return o[:, None], state, (s[:, None] if per_step else None)
  xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))                  # time-major
  state, (o, steps) = jax.lax.scan(step, state, xs)
  return jnp.moveaxis(o, 0, 1), state, (jnp.moveaxis(steps, 0, 1) if per_step else None)


def _chunk(s0, q, k, v, g, beta, per_step: bool):
  """One chunk of the parallel form. s0 [B, H, Dk, Dv]; q, k [B, H, C, Dk]; v [B, H, C, Dv];
  g, beta [B, H, C]. Returns (state at the end, (o [B, H, C, Dv], per-step states or None))."""
  c = q.shape[2]
  cum = jnp.cumsum(g, axis=-1)                                                    # [B, H, C] G_i
  lower = jnp.tril(jnp.ones((c, c), bool))                                        # j <= i
  diff = cum[..., :, None] - cum[..., None, :]                                    # [B, H, C, C] G_i - G_j
  decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)             # never exp(> 0)
  k_beta = k * beta[..., None]
  # (I + L) U = beta V - beta exp(G) K S0, L strictly lower: the u_t of every position at once
  gram = jnp.einsum("bhid,bhjd->bhij", k_beta, k, precision=HIGHEST) * decay       # [B, H, C, C]
  system = jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), gram, 0.0) + jnp.eye(c, dtype=gram.dtype)
  rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None]], axis=-1)
  sol = jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)
  dv = v.shape[-1]
  u = sol[..., :dv] - jnp.einsum("bhcd,bhdv->bhcv", sol[..., dv:], s0, precision=HIGHEST)   # [B, H, C, Dv]
  # o_i = exp(G_i) S0^T q_i + sum_{j <= i} exp(G_i - G_j) (q_i . k_j) u_j
  attn = jnp.einsum("bhid,bhjd->bhij", q, k, precision=HIGHEST) * decay
  o = (jnp.einsum("bhcd,bhdv->bhcv", q * jnp.exp(cum)[..., None], s0, precision=HIGHEST)
       + jnp.einsum("bhij,bhjv->bhiv", attn, u, precision=HIGHEST))
  # S_C = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T
  tail = jnp.exp(cum[..., -1:] - cum)                                             # [B, H, C]
  s_end = (s0 * jnp.exp(cum[..., -1])[..., None, None]
           + jnp.einsum("bhcd,bhcv->bhdv", k * tail[..., None], u, precision=HIGHEST))
  steps = None
  if per_step:   # S_i = exp(G_i) S0 + sum_{j <= i} exp(G_i - G_j) k_j u_j^T
    steps = (s0[:, :, None] * jnp.exp(cum)[..., None, None]
             + jnp.einsum("bhij,bhjd,bhjv->bhidv", decay, k, u, precision=HIGHEST))   # [B, H, C, Dk, Dv]
  return s_end, (o, steps)


def gated_delta_chunked(q, k, v, g, beta, state, *, chunk: int = 64, per_step: bool = False):
  """Parallel (chunked) gated delta rule; same arguments and results as `gated_delta_recurrent`.

  A block of T <= chunk tokens (verification) is one chunk of width T, no padding; longer blocks
  are padded to a multiple of `chunk` with identity updates and scanned chunk by chunk.
  """
  b, t, h, _ = k.shape
  c = t if t <= chunk else chunk
  pad = (-t) % c
  if pad:
    padt = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    q, k, v, g, beta = (padt(a) for a in (q, k, v, g, beta))                     # g = beta = 0: identity
  n = (t + pad) // c
  to_chunks = lambda a: jnp.moveaxis(a.reshape((b, n, c) + a.shape[2:]), 3, 2).swapaxes(0, 1)   # [N, B, H, C, ...]
  xs = tuple(to_chunks(a) for a in (q, k, v, g, beta))
  if n == 1:
    state, (o, steps) = _chunk(state, *(a[0] for a in xs), per_step)
    o, steps = o[None], (None if steps is None else steps[None])
  else:
    state, (o, steps) = jax.lax.scan(lambda s, x: _chunk(s, *x, per_step), state, xs)
  o = jnp.moveaxis(o.swapaxes(0, 1), 2, 3).reshape(b, n * c, h, -1)[:, :t]        # [B, T, H, Dv]
  if per_step:
    steps = jnp.moveaxis(steps.swapaxes(0, 1), 2, 3).reshape((b, n * c, h) + steps.shape[-2:])[:, :t]
  return o, state, steps


# ----------------------------------------------------------------------------------------------
# the layer


class GatedDeltaNet(nnx.Module):
  """Qwen3.5 `linear_attn`: fused input projection [qkv | z | b | a], causal conv, gated delta
  rule, gated RMSNorm, output projection."""

  def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
    d, hk, hv = cfg.d_model, cfg.lin_k_heads, cfg.lin_v_heads
    self.key_dim, self.value_dim = hk * cfg.lin_k_dim, hv * cfg.lin_v_dim
    self.conv_dim = 2 * self.key_dim + self.value_dim
    # One GEMM for the four HF projections in_proj_qkv, in_proj_z, in_proj_b, in_proj_a.
    self.in_proj = Linear(d, self.conv_dim + self.value_dim + 2 * hv, bias=False, dtype=dtype, rngs=rngs)
    k = cfg.conv_kernel
    conv = jax.random.normal(rngs.params(), (self.conv_dim, k), jnp.float32) * k ** -0.5
    self.conv1d = nnx.Param(conv.astype(dtype))                                    # [C, K] (HF [C, 1, K])
    self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1.0, 16.0)).astype(dtype))
    self.dt_bias = nnx.Param(jnp.ones((hv,), dtype))
    self.norm = RMSNorm(cfg.lin_v_dim, cfg.norm_eps, offset=False, dtype=dtype)
    self.out_proj = Linear(self.value_dim, d, bias=False, dtype=dtype, rngs=rngs)
    self.hk, self.hv, self.dk, self.dv = hk, hv, cfg.lin_k_dim, cfg.lin_v_dim
    self.chunk = cfg.chunk_size

  def __call__(self, x, conv_state, rec_state, n_new, *, mode: str, per_step: bool):
    """x [B, T, d_model]; conv_state [B, K-1, C]; rec_state [B, Hv, Dk, Dv]; n_new [B] valid tokens.

    mode "recurrent" | "chunked". Returns (out [B, T, d_model], (conv_state, rec_state) after the
    n_new tokens, per-step (conv [B, T, K-1, C], rec [B, T, Hv, Dk, Dv]) or None).
    """
    b, t, _ = x.shape
    proj = self.in_proj(x)                                                         # [B, T, C + Vd + 2Hv]
    mixed, z, beta_in, a = jnp.split(proj, [self.conv_dim, self.conv_dim + self.value_dim,
                                            self.conv_dim + self.value_dim + self.hv], axis=-1)
    mixed, window = causal_conv(mixed, conv_state, self.conv1d[...])              # [B, T, C]
    q, k, v = jnp.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
    rep = self.hv // self.hk                                                       # grouped value heads
    q = jnp.repeat(l2norm(q.reshape(b, t, self.hk, self.dk)), rep, axis=2) * self.dk ** -0.5   # [B, T, Hv, Dk]
    k = jnp.repeat(l2norm(k.reshape(b, t, self.hk, self.dk)), rep, axis=2)
    v = v.reshape(b, t, self.hv, self.dv)                                          # [B, T, Hv, Dv]
    valid = (jnp.arange(t)[None, :] < n_new[:, None])[..., None]                   # [B, T, 1]
    beta = jnp.where(valid, jax.nn.sigmoid(beta_in), 0.0)                          # [B, T, Hv]
    g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias[...].astype(jnp.float32))
    g = jnp.where(valid, g, 0.0)
    s0 = rec_state.astype(jnp.float32)
    if mode == "recurrent":
      o, rec, rec_steps = gated_delta_recurrent(q, k, v, g, beta, s0, per_step=per_step)
    else:
      o, rec, rec_steps = gated_delta_chunked(q, k, v, g, beta, s0, chunk=self.chunk, per_step=per_step)
    o = self.norm(o) * jax.nn.silu(z.reshape(b, t, self.hv, self.dv))            # gated RMSNorm per head
    out = self.out_proj(o.reshape(b, t, self.value_dim))
    k1 = conv_state.shape[1]
    new = (conv_state_after(window, n_new, k1).astype(conv_state.dtype), rec)
    steps = (conv_states_per_step(window, t, k1).astype(conv_state.dtype), rec_steps) if per_step else None
    return out, new, steps
