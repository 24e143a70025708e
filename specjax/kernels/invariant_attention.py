"""Attention whose result for one query does not depend on how many queries are computed with it.

A query at rotary position p sees the keys at positions 0..p: the committed history and, in a
speculative round, the new tokens on its own path (a chain's earlier tokens, a tree node's
ancestors). The verification kernel (`verify_attention`) splits the history into ranges sized by
the grid and scores the new tokens apart, so its sums round differently for a one-token decode
and for the same position inside a K+1 chain or a tree. Here one program serves one query (its G
query heads sharing a KV head are the rows of its tiles) and walks the keys in blocks of
`block_k` *logical positions*, from the first block to the block holding p, with an online
softmax in float32. Block j holds the keys at positions [j*BK, (j+1)*BK): the same values in the
same lanes whether they come from the cache or from the round, masked lanes hold zeros, so the
program's arithmetic, and its result, depend only on the query and the keys it sees.

Where the keys come from:
- causal (chains, decode, prefill): the key at position s sits in cache slot s; lanes past p are
  masked;
- trees (`new_mask` given): the tree's nodes sit in slots L.. (L = committed length) in node
  order, not at their positions, so the blocks from L's block on are gathered in XLA into a
  per-query tail in position order: committed slots, then the query's ancestors by depth (the
  ancestor at position L + i is the visible new token whose position is L + i). Blocks before L's
  block are read from the cache as in the causal case.

A sliding window (`window`) masks positions p - window and earlier and skips whole blocks below it.
On a GPU the kernel is lowered by Pallas to Triton; elsewhere it runs in Pallas interpret mode
(`specjax.kernels.interpreted`: at least two grid steps).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specjax.kernels import interpreted

NEG_INF = -1e30
NEVER = 1 << 30            # tail block index of causal queries: no block is read from a tail


def block_k_for(head_dim: int) -> int:
  """Keys per loop step (a model constant: never a function of the number of queries)."""
  return 64 if head_dim <= 128 else 32


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _kernel(pos_ref, lim_ref, tb_ref, q_ref, k_ref, v_ref, tk_ref, tv_ref, tvis_ref, o_ref, *,
            scale: float, block_k: int, window: int | None, precision):
  """One (sequence, KV head, query) program.

  pos_ref [] the query's position p; lim_ref [] keys below this position come from the cache;
  tb_ref [] first block read from the tail (NEVER: none); q_ref [GM, D]; k_ref, v_ref [S, D]
  cache of this sequence and head; tk_ref, tv_ref [W, D] tail; tvis_ref [W] int32 visible tail
  lanes; o_ref [GM, D] float32.
  """
  p, lim, tb = pos_ref[()], lim_ref[()], tb_ref[()]
  q = q_ref[...]                                                                 # [GM, D]
  gm, d = q.shape
  first = 0 if window is None else jnp.maximum(p - window + 1, 0) // block_k
  last = p // block_k + 1

  def body(j, carry):
    o, m, l = carry
    kpos = j * block_k + jnp.arange(block_k)                                     # [BK] key positions
    seen = kpos <= p
    if window is not None:
      seen = seen & (p - kpos < window)
    use_tail = j >= tb
    c_vis = seen & (kpos < lim) & ~use_tail                                      # [BK] from the cache
    t_at = jnp.maximum(j - tb, 0) * block_k
    t_vis = seen & use_tail & (plgpu.load(tvis_ref.at[pl.ds(t_at, block_k)], mask=seen & use_tail, other=0) != 0)
    load = lambda ref, at, vis: plgpu.load(ref.at[pl.ds(at, block_k), :], mask=vis[:, None], other=0)
    k = jnp.where(use_tail, load(tk_ref, t_at, t_vis), load(k_ref, j * block_k, c_vis))   # [BK, D]
    vis = c_vis | t_vis
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale                  # [GM, BK] float32
    s = jnp.where(vis[None, :], s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))                                   # [GM]
    corr = jnp.exp(m - m_new)
    pr = jnp.exp(s - m_new[:, None])                                             # [GM, BK]
    v = jnp.where(use_tail, load(tv_ref, t_at, t_vis), load(v_ref, j * block_k, c_vis))
    o = corr[:, None] * o + plgpu.dot(pr.astype(v.dtype), v, precision=precision)   # [GM, D]
    return o, m_new, corr * l + jnp.sum(pr, axis=1)

  init = (jnp.zeros((gm, d), jnp.float32), jnp.full((gm,), NEG_INF, jnp.float32), jnp.zeros((gm,), jnp.float32))
  o, _, l = lax.fori_loop(first, last, body, init)
  plgpu.store(o_ref, o / jnp.where(l > 0, l, 1.0)[:, None])


def tree_tail(k: jax.Array, v: jax.Array, lengths: jax.Array, positions: jax.Array, new_mask: jax.Array,
              block_k: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Per-query keys from L's block on, in position order (module docstring).

  k, v [B, S, KVH, D] with the T new tokens at slots L..L+T-1; lengths [B] = L; positions [B, T]
  (L + depth); new_mask [B, T, T] bool (ancestors and self). Returns (tail_k, tail_v
  [B, T, W, KVH, D] with zeros where not visible, tail_vis [B, T, W] int32, first tail block [B]).
  """
  b, s_cap, _, _ = k.shape
  t = positions.shape[1]
  w = block_k * (-(-(block_k + t - 1) // block_k))                             # covers L..L+T-1 from L's block
  tb = lengths // block_k                                                        # [B]
  pos = tb[:, None] * block_k + jnp.arange(w)[None, :]                           # [B, W] tail positions
  depth = positions - lengths[:, None]                                           # [B, T] new index of each token
  # at[b, t, i] = the new token at position L + i that query t sees (its ancestor at depth i)
  hit = new_mask[:, :, :, None] & (depth[:, None, :, None] == jnp.arange(t)[None, None, None, :])   # [B, T, U, I]
  found = jnp.any(hit, axis=2)                                                   # [B, T, I]
  at = jnp.argmax(hit, axis=2).astype(jnp.int32)                                 # [B, T, I]
  i = pos - lengths[:, None]                                                     # [B, W] index among new tokens
  is_new = (i >= 0)[:, None, :]                                                  # [B, 1, W]
  ic = jnp.broadcast_to(jnp.clip(i, 0, t - 1)[:, None, :], (b, t, w))            # [B, T, W]
  slot = jnp.where(is_new, lengths[:, None, None] + jnp.take_along_axis(at, ic, axis=2), pos[:, None, :])
  vis = jnp.where(is_new, jnp.take_along_axis(found, ic, axis=2) & (i < t)[:, None, :], True)
  vis = vis & (pos[:, None, :] <= positions[:, :, None]) & (slot < s_cap)        # [B, T, W]
  slot = jnp.clip(slot, 0, s_cap - 1)
  rows = jnp.arange(b)[:, None, None]
  gather = lambda x: jnp.where(vis[..., None, None], x[rows, slot], 0).astype(x.dtype)   # [B, T, W, KVH, D]
  return gather(k), gather(v), vis.astype(jnp.int32), tb


def invariant_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, positions: jax.Array,
                        scale: float, *, new_mask: jax.Array | None = None, window: int | None = None,
                        interpret: bool | None = None) -> jax.Array:
  """Attention of q [B, T, H, D] over k, v [B, S, KVH, D] (the T new tokens written at slots
  lengths..lengths+T-1). new_mask None: causal, the new token t is at position lengths + t
  (`positions` is then not read); else [B, T, T] bool among the new tokens (a tree's ancestors),
  positions [B, T] = lengths + depth. -> [B, T, H, D] float32."""
  b, t, h, d = q.shape
  kvh = k.shape[2]
  g = h // kvh
  if d != _pow2(d) or d < 16:
    raise ValueError(f"invariant attention needs a power-of-two head_dim >= 16, got {d}")
  interpret = interpreted.interpret_default(interpret)
  if interpret and b * kvh * t == 1:   # a one-step interpreted grid (kernels/interpreted.py): run two
    two = lambda x: None if x is None else jnp.concatenate([x, x])
    return invariant_attention(two(q), two(k), two(v), two(lengths), two(positions), scale, new_mask=two(new_mask),
                               window=window, interpret=True)[:1]
  gm = max(16, _pow2(g))
  bk = block_k_for(d)
  lengths = lengths.astype(jnp.int32)
  if new_mask is None:
    pos = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]             # [B, T]
    lim = pos + 1
    tb = jnp.full((b, t), NEVER, jnp.int32)
    tk, tv = k[:, None], v[:, None]                                              # never read: every lane masked
    tvis = jnp.zeros((b, 1, bk), jnp.int32)                                      # [B, 1, BK]
    tail_index = lambda i, hh, j: (i, 0, 0, hh, 0)
    vis_index = lambda i, hh, j: (i, 0, 0)
  else:
    pos = positions.astype(jnp.int32)
    tk, tv, tvis, tb1 = tree_tail(k, v, lengths, pos, new_mask, bk)
    lim = jnp.broadcast_to(lengths[:, None], (b, t))
    tb = jnp.broadcast_to(tb1[:, None], (b, t))
    tail_index = lambda i, hh, j: (i, j, 0, hh, 0)
    vis_index = lambda i, hh, j: (i, j, 0)
  w = tk.shape[2]
  qr = q.reshape(b, t, kvh, g, d).astype(k.dtype)
  qr = jnp.pad(qr, ((0, 0), (0, 0), (0, 0), (0, gm - g), (0, 0)))               # [B, T, KVH, GM, D]
  s_cap = k.shape[1]
  scalar = pl.BlockSpec((None, None), lambda i, hh, j: (i, j))
  cache = pl.BlockSpec((None, s_cap, None, d), lambda i, hh, j: (i, 0, hh, 0))
  tail = pl.BlockSpec((None, None, w, None, d), tail_index)
  precision = lax.Precision.HIGHEST if k.dtype == jnp.float32 else None
  out = pl.pallas_call(
      functools.partial(_kernel, scale=float(scale), block_k=bk, window=window, precision=precision),
      grid=(b, kvh, t),
      in_specs=[scalar, scalar, scalar,
                pl.BlockSpec((None, None, None, gm, d), lambda i, hh, j: (i, j, hh, 0, 0)),
                cache, cache, tail, tail, pl.BlockSpec((None, None, tvis.shape[2]), vis_index)],
      out_specs=pl.BlockSpec((None, None, None, gm, d), lambda i, hh, j: (i, j, hh, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((b, t, kvh, gm, d), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="invariant_attention",
  )(pos, lim, tb, qr, k, v, tk, tv, tvis)                                       # [B, T, KVH, GM, D]
  return out[:, :, :, :g].reshape(b, t, h, d)
