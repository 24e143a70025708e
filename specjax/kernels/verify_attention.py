"""Verification attention: T new queries per sequence over a KV cache with per-sequence lengths.

A speculative round scores K+1 chain tokens (causal among themselves) or T tree nodes (an
ancestor mask [B, T, T]) against every committed slot of its sequence. The new tokens' K/V are
already written at slots `length .. length+T-1` (`KVCache.write`); slots at or past `length + T`
are stale and never enter the result.

Two implementations of one function:
- `attend_reference`: the XLA math over a dense visibility mask [B, T, S] (every slot of the
  cache is scored, then masked);
- `pallas_verify_attention`: a Pallas (Triton lowering) split-K kernel. One program handles one
  (sequence, KV head, row block, split): the G query heads sharing the KV head times the T new
  tokens form the M dimension of its matmuls, so each K/V block is read once per group. The
  committed slots `[0, length)` are cut into `n_splits` ranges (only blocks below `length` are
  read: the cache's capacity costs nothing), and one extra program per (sequence, head) scores
  the T new slots under the chain / tree mask. Partial results are merged with their
  log-sum-exp weights in XLA (`merge_partials`).

`attention` dispatches: the kernel on GPU (T > 1, and T = 1 unless SPECJAX_VERIFY_ATTENTION_DECODE=0),
the reference elsewhere; SPECJAX_VERIFY_ATTENTION=xla|pallas|auto (or `set_impl`) forces either.
On a CPU, `pallas` runs the kernel in Pallas interpret mode (tests). Under `auto` each new kernel
shape is compiled and checked against the reference once; if that fails, a warning is logged once
and the reference is used.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from specjax.kernels import dispatch

NEG_INF = -1e30
IMPL_ENV = "SPECJAX_VERIFY_ATTENTION"            # auto (default) | pallas | xla
DECODE_ENV = "SPECJAX_VERIFY_ATTENTION_DECODE"   # "0": one-token decode stays on the reference
MAX_ROWS = 512                                   # G*T above this (prefill) stays on the reference

log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedMask:
  """What the dense visibility mask is made of, for the kernel: slot s is visible to new token t
  iff s < lengths, or s = lengths + u (u < T, s < capacity) with new_mask[t, u]."""
  lengths: jax.Array      # [B] int32 committed slots
  new_mask: jax.Array     # [B, T, T] bool among the new tokens (causal, or a tree's ancestors)


def causal_new_mask(batch: int, t: int) -> jax.Array:
  """[B, T, T] bool: new token t sees new tokens u <= t."""
  ar = jnp.arange(t)
  return jnp.broadcast_to(ar[None, :] <= ar[:, None], (batch, t, t))


def dense_visibility(ragged: RaggedMask, capacity: int) -> jax.Array:
  """The [B, T, S] bool mask a RaggedMask stands for."""
  b, t, _ = ragged.new_mask.shape
  slot = jnp.arange(capacity, dtype=jnp.int32)[None, :]                          # [1, S]
  rel = slot - ragged.lengths[:, None]                                           # [B, S]
  is_new = (rel >= 0) & (rel < t)
  rel_c = jnp.clip(rel, 0, t - 1)
  new_visible = jnp.take_along_axis(ragged.new_mask, jnp.broadcast_to(rel_c[:, None, :], (b, t, capacity)), axis=2)
  return (rel < 0)[:, None, :] | (is_new[:, None, :] & new_visible)              # [B, T, S]


def attend_reference(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
  """Grouped-query attention over the whole cache (XLA).

  q [B, T, H, D]; k, v [B, S, KVH, D]; mask [B, T, S] bool (True = visible). -> [B, T, H, D] f32
  """
  b, t, h, d = q.shape
  kvh = k.shape[2]
  qg = q.reshape(b, t, kvh, h // kvh, d).astype(k.dtype)                          # [B, T, KVH, G, D]
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
  scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)                  # [B, KVH, G, T, S]
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)   # [B, T, KVH, G, D]
  return out.reshape(b, t, h, d)


# ----------------------------------------------------------------------------------------------
# the Pallas kernel


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Static sizes of one kernel instance (rows and block_* are powers of two >= 16)."""
  rows: int          # G*T query rows per (sequence, KV head), padded to a power of two
  block_m: int       # rows per program
  block_k: int       # cache slots per loop step
  block_t: int       # new-token slots, T padded
  n_splits: int      # programs over the committed slots of one (sequence, head, row block); 0: one
                     # program takes the committed and the new slots (a single pass, nothing to merge)
  num_warps: int
  num_stages: int = 2


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


MAX_SPLITS = 256                                 # bounds the partials the merge reads back
PROGRAMS_PER_SM = 1                              # split target: programs over the committed slots per SM. At
                                                 # batch 1 one per SM was faster than two on most shapes and
                                                 # never much slower
                                                 # (experiments/results/verify_attention_b1split_h100.json)


def split_plan(batch: int, n_kv: int, n_rb: int, capacity: int, sm_count: int,
               max_block_k: int = 128) -> tuple[int, int]:
  """(block_k, n_splits) for the committed slots: enough programs to fill the GPU.

  The grid has batch * n_kv * n_rb * n_splits programs over the committed slots. At batch 1 with
  few KV heads that product is small, so the split count grows until the grid holds about
  PROGRAMS_PER_SM programs per SM, bounded by the cache: a split holds at least one block of
  `block_k` slots (the capacity is the static bound on the context), and by MAX_SPLITS. When
  blocks of `max_block_k` slots are too few to reach the target, blocks of 64 give more splits.
  """
  per_split = batch * n_kv * n_rb
  want = -(-PROGRAMS_PER_SM * sm_count // per_split)
  block_k = max_block_k if -(-capacity // max_block_k) >= want else min(64, max_block_k)
  return block_k, max(1, min(want, -(-capacity // block_k), MAX_SPLITS))


def tiling_for(batch: int, t: int, n_heads: int, n_kv: int, head_dim: int, capacity: int,
               sm_count: int | None = None) -> Tiling | None:
  """Block shapes for these sizes, or None where the kernel does not apply (prefill-sized T,
  head_dim not a power of two)."""
  if n_heads % n_kv or head_dim != _pow2(head_dim) or not 16 <= head_dim <= 256:
    return None
  g = n_heads // n_kv
  rows = max(16, _pow2(g * t))
  if rows > MAX_ROWS:
    return None
  block_m = min(rows, 128, 16384 // head_dim)          # accumulator [block_m, D] f32 in registers
  n_rb = rows // block_m
  max_block_k = 64 if block_m * head_dim >= 8192 else 128   # big accumulators: smaller K/V tiles
  block_k, n_splits = split_plan(batch, n_kv, n_rb, capacity, sm_count or dispatch.sm_count(), max_block_k)
  return Tiling(rows=rows, block_m=block_m, block_k=block_k, block_t=max(16, _pow2(t)),
                n_splits=n_splits, num_warps=8 if block_m * head_dim >= 16384 else 4)


def _kernel(len_ref, q_ref, k_ref, v_ref, vis_ref, o_ref, m_ref, l_ref, *,
            scale: float, t: int, block_k: int, n_splits: int, precision):
  """One (sequence, KV head, row block, split) program.

  len_ref []; q_ref [BM, D]; k_ref, v_ref [S, D] (this sequence and head); vis_ref [BM, BT]
  new-token visibility per row; out: o_ref [BM, D] (normalized partial), m_ref, l_ref [BM].
  With n_splits >= 1, programs 0 .. n_splits - 1 cover the committed slots and program n_splits
  the new ones; with n_splits = 0 the one program covers both (no partials to merge).
  """
  split = pl.program_id(2)
  length = len_ref[()]
  capacity = k_ref.shape[0]
  q = q_ref[...]                                                                 # [BM, D]
  bm, d = q.shape
  n_blocks = (length + block_k - 1) // block_k

  def finish(o, m, l):   # the normalized partial and its log-sum-exp terms
    plgpu.store(o_ref, (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype))
    plgpu.store(m_ref, m)
    plgpu.store(l_ref, l)

  def committed_block(i, carry):   # online softmax over committed slots [i * BK, (i + 1) * BK)
    o, m, l = carry
    start = i * block_k
    valid = (start + jnp.arange(block_k)) < length                               # [BK]
    k = plgpu.load(k_ref.at[pl.ds(start, block_k), :], mask=valid[:, None], other=0.0)   # [BK, D]
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale                  # [BM, BK] f32
    s = jnp.where(valid[None, :], s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))                                   # [BM]
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])                                              # [BM, BK]
    v = plgpu.load(v_ref.at[pl.ds(start, block_k), :], mask=valid[:, None], other=0.0)
    o = corr[:, None] * o + plgpu.dot(p.astype(v.dtype), v, precision=precision)    # [BM, D]
    return o, m_new, corr * l + jnp.sum(p, axis=1)

  def new_slots(o, m, l):   # the new tokens' slots [length, length + T) under the mask among them
    bt = vis_ref.shape[1]
    u = jnp.arange(bt)
    valid = (u < t) & (length + u < capacity)                                    # [BT]
    k = plgpu.load(k_ref.at[pl.ds(length, bt), :], mask=valid[:, None], other=0.0)   # [BT, D]
    v = plgpu.load(v_ref.at[pl.ds(length, bt), :], mask=valid[:, None], other=0.0)
    vis = (vis_ref[...] != 0) & valid[None, :]                                   # [BM, BT]
    s = jnp.where(vis, plgpu.dot(q, k, trans_b=True, precision=precision) * scale, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
    o = corr[:, None] * o + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return o, m_new, corr * l + jnp.sum(p, axis=1)

  init = (jnp.zeros((bm, d), jnp.float32), jnp.full((bm,), NEG_INF, jnp.float32), jnp.zeros((bm,), jnp.float32))
  if n_splits == 0:
    finish(*new_slots(*lax.fori_loop(0, n_blocks, committed_block, init)))
    return

  @pl.when(split < n_splits)
  def _committed():
    lo = split * n_blocks // n_splits                                            # balanced: no split idles
    hi = (split + 1) * n_blocks // n_splits                                      # while blocks >= splits
    finish(*lax.fori_loop(lo, hi, committed_block, init))

  @pl.when(split == n_splits)
  def _new_tokens():
    finish(*new_slots(*init))


def merge_partials(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
  """The split partials merged by their log-sum-exp weights: the weight of split j is
  l_j * exp(m_j - max m). o [B, KVH, NS, R, D] (each split's normalized output), m, l [B, KVH, NS, R]
  -> [B, KVH, R, D] f32 (three XLA kernels: the max, the weights, the weighted sums)."""
  w = l * jnp.exp(m - jnp.max(m, axis=2, keepdims=True))                         # [B, KVH, NS, R]
  total = jnp.sum(w, axis=2)                                                     # [B, KVH, R]
  out = jnp.sum(w[..., None] * o.astype(jnp.float32), axis=2)                  # [B, KVH, R, D] (one fusion)
  return out / jnp.where(total > 0, total, 1.0)[..., None]


def pallas_verify_attention(q: jax.Array, k: jax.Array, v: jax.Array, ragged: RaggedMask, scale: float, *,
                            tiling: Tiling | None = None, interpret: bool = False) -> jax.Array:
  """Same result as `attend_reference(q, k, v, dense_visibility(ragged, S), scale)`.

  q [B, T, H, D]; k, v [B, S, KVH, D] with the new tokens written; -> [B, T, H, D] f32.
  """
  b, t, h, d = q.shape
  s_cap, kvh = k.shape[1], k.shape[2]
  g = h // kvh
  tl = tiling or tiling_for(b, t, h, kvh, d, s_cap)
  if tl is None:
    raise ValueError(f"no kernel tiling for T={t}, H={h}, KVH={kvh}, D={d}")
  n_rb = tl.rows // tl.block_m
  # rows r = t * G + g of each (sequence, KV head), padded to tl.rows
  qr = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, t * g, d).astype(k.dtype)
  qr = jnp.pad(qr, ((0, 0), (0, 0), (0, tl.rows - t * g), (0, 0)))             # [B, KVH, R, D]
  row_t = jnp.minimum(jnp.arange(tl.rows) // g, t - 1)                           # [R] new token of a row
  vis = jnp.take(ragged.new_mask, row_t, axis=1)                                 # [B, R, T]
  vis = vis & (jnp.arange(tl.rows) < t * g)[None, :, None]
  vis = jnp.pad(vis, ((0, 0), (0, 0), (0, tl.block_t - t))).astype(jnp.int32)   # [B, R, BT]
  lengths = ragged.lengths.astype(jnp.int32)
  n_out = tl.n_splits + 1

  head = lambda hr: hr // n_rb
  rblk = lambda hr: hr % n_rb
  # precision None: the backend's default for the dtype, as the reference's einsums get
  kernel = functools.partial(_kernel, scale=float(scale), t=t, block_k=tl.block_k, n_splits=tl.n_splits,
                             precision=None)
  o, m, l = pl.pallas_call(
      kernel,
      grid=(b, kvh * n_rb, n_out),
      in_specs=[
          pl.BlockSpec((None,), lambda i, hr, j: (i,)),
          pl.BlockSpec((None, None, tl.block_m, d), lambda i, hr, j: (i, head(hr), rblk(hr), 0)),
          pl.BlockSpec((None, s_cap, None, d), lambda i, hr, j: (i, 0, head(hr), 0)),
          pl.BlockSpec((None, s_cap, None, d), lambda i, hr, j: (i, 0, head(hr), 0)),
          pl.BlockSpec((None, tl.block_m, tl.block_t), lambda i, hr, j: (i, rblk(hr), 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, tl.block_m, d), lambda i, hr, j: (i, head(hr), j, rblk(hr), 0)),
          pl.BlockSpec((None, None, None, tl.block_m), lambda i, hr, j: (i, head(hr), j, rblk(hr))),
          pl.BlockSpec((None, None, None, tl.block_m), lambda i, hr, j: (i, head(hr), j, rblk(hr))),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((b, kvh, n_out, tl.rows, d), k.dtype),
          jax.ShapeDtypeStruct((b, kvh, n_out, tl.rows), jnp.float32),
          jax.ShapeDtypeStruct((b, kvh, n_out, tl.rows), jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=tl.num_warps, num_stages=tl.num_stages),
      interpret=interpret,
      name="verify_attention",
  )(lengths, qr, k, v, vis)
  out = merge_partials(o, m, l) if n_out > 1 else o[:, :, 0].astype(jnp.float32)   # [B, KVH, R, D] f32
  out = out[:, :, :t * g].reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4)      # [B, T, KVH, G, D]
  return out.reshape(b, t, h, d)


# ----------------------------------------------------------------------------------------------
# dispatch


SWITCH = dispatch.KernelSwitch("verify_attention", IMPL_ENV)
set_impl = SWITCH.set_impl
current_impl = SWITCH.current_impl


def _probe(b, t, h, kvh, d, s_cap, dtype, tiling: Tiling) -> tuple[bool, str]:
  """Kernel vs reference on random inputs of these shapes (compiles both): max |difference|
  within the dtype's tolerance (a wrong mask errs by O(0.1..1))."""
  rng = np.random.default_rng(0)
  normal = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  q, k, v = normal((b, t, h, d)), normal((b, s_cap, kvh, d)), normal((b, s_cap, kvh, d))
  lengths = jnp.asarray(rng.integers(0, s_cap - t + 1, b), jnp.int32)
  ragged = RaggedMask(lengths, jnp.asarray(np.tril(np.ones((b, t, t), bool))))
  scale = d ** -0.5
  got = jax.jit(functools.partial(pallas_verify_attention, scale=scale, tiling=tiling))(q, k, v, ragged)
  want = jax.jit(lambda q, k, v, r: attend_reference(q, k, v, dense_visibility(r, s_cap), scale))(q, k, v, ragged)
  err = float(jnp.max(jnp.abs(got - want)))
  tol = 3e-2 if jnp.dtype(dtype) == jnp.bfloat16 else 1e-2
  return err <= tol, f"max abs difference {err:.3g}"


def choose(q_shape, k_shape, dtype, ragged: RaggedMask | None) -> tuple[str, Tiling | None]:
  """("pallas", tiling) or ("xla", None) for these shapes under the current setting."""
  if ragged is None:
    return "xla", None
  impl = current_impl()
  if impl == "xla":
    return impl, None
  b, t, h, d = q_shape
  s_cap, kvh = k_shape[1], k_shape[2]
  tiling = tiling_for(b, t, h, kvh, d, s_cap)
  if tiling is None:
    return "xla", None
  if impl == "pallas":
    return "pallas", tiling
  # one-token decode too: the kernel is faster than the reference at T = 1 as well
  # (experiments/results/verify_attention_grid_h100.json, K = 0), and adaptive drafting's width-0
  # rounds would otherwise cost more than its width-1 rounds on the kernel
  wanted = t > 1 or os.environ.get(DECODE_ENV, "1") == "1"
  key = (b, t, h, kvh, d, s_cap, jnp.dtype(dtype).name, tiling)   # compiled and compared once per shape
  if wanted and SWITCH.auto_serves(key, functools.partial(_probe, b, t, h, kvh, d, s_cap, dtype, tiling), log):
    return "pallas", tiling
  return "xla", None


def mesh_split(batch: int, n_heads: int, n_kv: int):
  """How the mesh of the jitted caller (`jax.set_mesh`, `specjax.parallel.use`) splits one
  attention call: (mesh, batch axis or None, head axis or None), or None without a mesh. The batch
  goes over "data" where data divides it, the heads over "model" where model divides the query and
  KV heads (a target's: its KV cache lives so; `parallel.pad_heads` makes them divide)."""
  from specjax.parallel.mesh import DATA, MODEL
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or MODEL not in mesh.axis_names:
    return None
  data, model = mesh.shape.get(DATA, 1), mesh.shape[MODEL]
  b_axis = DATA if data > 1 and batch % data == 0 else None
  h_axis = MODEL if model > 1 and n_heads % model == 0 and n_kv % model == 0 else None
  return (mesh, b_axis, h_axis) if b_axis or h_axis else None


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
              ragged: RaggedMask | None = None) -> jax.Array:
  """Attention of q [B, T, H, D] over the cache k, v [B, S, KVH, D] under `mask` [B, T, S]
  (which `ragged`, when given, describes exactly). -> [B, T, H, D] f32.

  Under a mesh the Pallas kernel runs per shard (`jax.shard_map`: each device its rows of the
  batch and its KV groups, the query heads of a group beside its K and V), with the tiling of the
  per-device shapes: XLA cannot split a custom kernel itself, and left to it gathers q, k and v of
  every layer onto every device. The XLA reference is split by XLA like the rest of the model."""
  split = mesh_split(q.shape[0], q.shape[2], k.shape[2])
  q_shape, k_shape = q.shape, k.shape
  if split is not None:
    mesh, b_axis, h_axis = split
    div = lambda n, ax: n // mesh.shape[ax] if ax else n
    q_shape = (div(q.shape[0], b_axis), q.shape[1], div(q.shape[2], h_axis), q.shape[3])
    k_shape = (div(k.shape[0], b_axis), k.shape[1], div(k.shape[2], h_axis), k.shape[3])
  impl, tiling = choose(q_shape, k_shape, k.dtype, ragged)
  if impl == "xla":
    return attend_reference(q, k, v, mask, scale)
  kernel = functools.partial(pallas_verify_attention, scale=scale, tiling=tiling, interpret=not dispatch.on_gpu())
  if split is None:
    return kernel(q, k, v, ragged)
  heads = P(b_axis, None, h_axis, None)                                          # [B, T|S, H|KVH, D]
  per_shard = jax.shard_map(lambda q, k, v, lengths, new: kernel(q, k, v, RaggedMask(lengths, new)), mesh=mesh,
                            in_specs=(heads, heads, heads, P(b_axis), P(b_axis)), out_specs=heads, check_vma=False)
  return per_shard(q, k, v, ragged.lengths, ragged.new_mask)
