"""The accept / resample step of a chain round over the vocabulary, with pre-drawn randomness.

Given target distributions p [B, K+1, V] at [last, d1..dK], drafts d [B, K] with lengths, draft
distributions q [B, K, V] (or None: one-hot on the drafted token), uniforms u [B, K] and Gumbel
noise g [B, V], one round is

  n_acc  = number of leading i < draft_len with u_i * q_i(d_i) < p_i(d_i)     (u < p/q)
  dist   = max(p_n - q_n, 0) if n_acc < draft_len (rejected: the residual)  else p_n (bonus)
  next   = argmax_x log dist(x) + g(x)     (Gumbel-max: a sample of dist / sum(dist)), and if the
           residual is empty (p_n <= q_n everywhere, a rounding accident) argmax log p_n + g

with n = n_acc and q_n = q at min(n, K-1). The normalisation of the residual is left out: the
Gumbel-max argmax is unchanged by a constant shift of log dist, so the law is the normalised
residual's. Probabilities are taken in float32.

Two implementations of one function:
- `accept_sample_reference`: XLA ops (gathers, the row pick, residual, log, argmax);
- `pallas_accept_sample`: a Pallas (Triton lowering) kernel on a grid of (sequence, vocabulary
  split). Each program recomputes the sequence's acceptance test from the gathered p(d_i),
  q(d_i) and u (a few scalars), picks the row n_acc, and streams its slice of the vocabulary once:
  p_n, q_n (only when rejected) and g, keeping the running Gumbel-max of the residual and of
  p_n. The splits' maxima are merged in XLA (first maximum wins, as `jnp.argmax`). Both compute
  the same float32 values, so for the same u and g they return the same n_acc and token.

`accept_sample` dispatches like the verification-attention kernel (`dispatch.KernelSwitch`):
SPECJAX_ACCEPT_SAMPLE=auto|pallas|xla (or `set_impl`); `pallas` on a CPU runs the kernel in
interpret mode. Under auto the reference serves, unless `SWITCH.auto_kernel` is set (then: the kernel
on a GPU for shapes whose probe passed). The kernel is opt-in because it does not pay: over batch
1-64, K 4-16 and V 49152 its whole step was slower than XLA's at the median, and the step takes
tens of microseconds either way (experiments/results/accept_sample_h200.json).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specjax.kernels import dispatch

IMPL_ENV = "SPECJAX_ACCEPT_SAMPLE"   # auto (default) | pallas | xla
MAX_SPLITS = 64

log = logging.getLogger(__name__)


def _gather_drafted(x: jax.Array, draft: jax.Array) -> jax.Array:
  """x [B, K(+1), V] at the drafted tokens d_i of rows i < K -> [B, K] float32."""
  k = draft.shape[1]
  return jnp.take_along_axis(x[:, :k], draft[..., None], axis=-1)[..., 0].astype(jnp.float32)


def accepted_count(p_draft: jax.Array, q_draft: jax.Array, u: jax.Array, draft_len: jax.Array) -> jax.Array:
  """Leading accepted drafts [B]: p_draft, q_draft, u [B, K]; draft_len [B]."""
  k = u.shape[1]
  ok = (u * q_draft < p_draft) & (jnp.arange(k)[None, :] < draft_len[:, None])      # [B, K]
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)


def accept_sample_reference(p: jax.Array, draft: jax.Array, draft_len: jax.Array, u: jax.Array,
                            gumbel: jax.Array, q: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(n_accepted [B], next_token [B]) of one chain round (module docstring), in XLA.

  p [B, K+1, V]; draft [B, K] int; draft_len [B]; u [B, K]; gumbel [B, V] float32; q [B, K, V] or None.
  """
  b, k1, v = p.shape
  k = k1 - 1
  p_draft = _gather_drafted(p, draft)                                               # [B, K] p(d_i)
  q_draft = jnp.ones_like(p_draft) if q is None else _gather_drafted(q, draft)      # [B, K]
  n_acc = accepted_count(p_draft, q_draft, u.astype(jnp.float32), draft_len)        # [B]
  p_at = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0].astype(jnp.float32)   # [B, V]
  key_p = jnp.log(p_at) + gumbel                                                    # [B, V]
  if k == 0:
    return n_acc, jnp.argmax(key_p, axis=-1).astype(jnp.int32)
  idx = jnp.minimum(n_acc, k - 1)
  if q is None:
    d_at = jnp.take_along_axis(draft, idx[:, None], axis=1)                        # [B, 1]
    q_at = (jnp.arange(v)[None, :] == d_at).astype(jnp.float32)                    # [B, V] one-hot
  else:
    q_at = jnp.take_along_axis(q, idx[:, None, None], axis=1)[:, 0].astype(jnp.float32)
  key_res = jnp.log(jnp.maximum(p_at - q_at, 0.0)) + gumbel                         # [B, V]
  use_res = (n_acc < draft_len) & (jnp.max(key_res, axis=-1) > -jnp.inf)           # rejected, residual not empty
  token = jnp.where(use_res, jnp.argmax(key_res, axis=-1), jnp.argmax(key_p, axis=-1))
  return n_acc, token.astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# the Pallas kernel


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Static sizes of one kernel instance (block sizes are powers of two >= 16)."""
  block_k: int       # drafts, K padded
  block_v: int       # vocabulary entries per loop step
  n_splits: int      # programs over the vocabulary of one sequence
  num_warps: int = 4
  num_stages: int = 2


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def tiling_for(batch: int, k: int, vocab: int, sm_count: int | None = None) -> Tiling:
  """Blocks of 1024 vocabulary entries; splits so that batch x splits reaches 2x the SMs, at
  least one block per split."""
  block_v = min(1024, max(16, _pow2(vocab)))
  n_blocks = -(-vocab // block_v)
  want = -(-2 * (sm_count or dispatch.sm_count()) // batch)
  return Tiling(block_k=max(16, _pow2(k)), block_v=block_v, n_splits=max(1, min(want, n_blocks, MAX_SPLITS)))


def _argmax_update(best, best_idx, key, idx):
  """Running (max, first index of the max) after the block key [BV] at indices idx [BV]."""
  m = jnp.max(key)
  at = jnp.min(jnp.where(key == m, idx, jnp.iinfo(jnp.int32).max))
  better = m > best                                            # earlier (lower) indices win ties
  return jnp.where(better, m, best), jnp.where(better, at, best_idx)


def _kernel(dlen_ref, pd_ref, qd_ref, u_ref, draft_ref, p_ref, *rest, k: int, vocab: int, block_v: int,
            n_splits: int, has_q: bool):
  """One (sequence, vocabulary split) program.

  dlen_ref []; pd_ref, qd_ref, u_ref [BK] f32 (p(d_i), q(d_i), u_i; padding rejects); draft_ref
  [BK] int32; p_ref [K+1, V]; q_ref [K, V] when has_q; g_ref [V]; out: n_acc, the running maxima
  and their indices of log residual + g and of log p_n + g over this split's slice [].
  """
  if has_q:
    q_ref, g_ref, nacc_ref, res_ref, res_idx_ref, pm_ref, pm_idx_ref = rest
  else:
    q_ref = None
    g_ref, nacc_ref, res_ref, res_idx_ref, pm_ref, pm_idx_ref = rest
  split = pl.program_id(1)
  dlen = dlen_ref[()]
  i = jnp.arange(pd_ref.shape[0])
  ok = (u_ref[...] * qd_ref[...] < pd_ref[...]) & (i < dlen)                       # [BK]
  n_acc = jnp.min(jnp.where(ok, pd_ref.shape[0], i))                             # first rejection
  rejected = n_acc < dlen
  q_row = jnp.minimum(n_acc, max(k - 1, 0))
  d_at = jnp.sum(jnp.where(i == q_row, draft_ref[...], 0))                       # drafted token at q_row

  n_blocks = -(-vocab // block_v)
  lo = split * n_blocks // n_splits
  hi = (split + 1) * n_blocks // n_splits

  def body(j, carry):
    res, res_idx, pm, pm_idx = carry
    start = j * block_v
    idx = start + jnp.arange(block_v)                                            # [BV]
    valid = idx < vocab
    p = plgpu.load(p_ref.at[n_acc, pl.ds(start, block_v)], mask=valid, other=0.0).astype(jnp.float32)
    g = plgpu.load(g_ref.at[pl.ds(start, block_v)], mask=valid, other=0.0)
    if k == 0:
      q = jnp.zeros_like(p)
    elif has_q:   # q_n is only read for a rejected sequence
      q = plgpu.load(q_ref.at[q_row, pl.ds(start, block_v)], mask=valid & rejected, other=0.0).astype(jnp.float32)
    else:
      q = jnp.where(idx == d_at, 1.0, 0.0)
    key_res = jnp.where(valid, jnp.log(jnp.maximum(p - q, 0.0)) + g, -jnp.inf)
    key_p = jnp.where(valid, jnp.log(p) + g, -jnp.inf)
    res, res_idx = _argmax_update(res, res_idx, key_res, idx)
    pm, pm_idx = _argmax_update(pm, pm_idx, key_p, idx)
    return res, res_idx, pm, pm_idx

  first = (lo * block_v).astype(jnp.int32)
  init = (jnp.float32(-jnp.inf), first, jnp.float32(-jnp.inf), first)
  res, res_idx, pm, pm_idx = lax.fori_loop(lo, hi, body, init)
  nacc_ref[()] = n_acc.astype(jnp.int32)
  res_ref[()] = res
  res_idx_ref[()] = res_idx
  pm_ref[()] = pm
  pm_idx_ref[()] = pm_idx


def _pad_k(x: jax.Array, block_k: int, value) -> jax.Array:
  return jnp.pad(x, ((0, 0), (0, block_k - x.shape[1])), constant_values=value)


def pallas_accept_sample(p: jax.Array, draft: jax.Array, draft_len: jax.Array, u: jax.Array, gumbel: jax.Array,
                         q: jax.Array | None = None, *, tiling: Tiling | None = None,
                         interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Same result as `accept_sample_reference` (same arguments)."""
  b, k1, v = p.shape
  k = k1 - 1
  tl = tiling or tiling_for(b, k, v)
  if tl.block_k < k or tl.block_k != _pow2(tl.block_k):
    raise ValueError(f"block_k {tl.block_k} does not hold K={k}")
  p_draft = _gather_drafted(p, draft)                                               # [B, K]
  q_draft = jnp.ones_like(p_draft) if q is None else _gather_drafted(q, draft)
  # padding: p(d) = 0 < u * q(d) never holds, so a padded draft is never accepted
  pd = _pad_k(p_draft, tl.block_k, 0.0)                                             # [B, BK]
  qd = _pad_k(q_draft, tl.block_k, 1.0)
  uu = _pad_k(u.astype(jnp.float32), tl.block_k, 1.0)
  dr = _pad_k(draft.astype(jnp.int32), tl.block_k, 0)
  has_q = q is not None and k > 0
  row = lambda bi, j: (bi, 0)
  in_specs = [pl.BlockSpec((None,), lambda bi, j: (bi,))] + [pl.BlockSpec((None, tl.block_k), row)] * 4
  in_specs.append(pl.BlockSpec((None, k1, v), lambda bi, j: (bi, 0, 0)))
  args = [draft_len.astype(jnp.int32), pd, qd, uu, dr, p]
  if has_q:
    in_specs.append(pl.BlockSpec((None, k, v), lambda bi, j: (bi, 0, 0)))
    args.append(q)
  in_specs.append(pl.BlockSpec((None, v), lambda bi, j: (bi, 0)))
  args.append(gumbel.astype(jnp.float32))
  scalar = pl.BlockSpec((None, None), lambda bi, j: (bi, j))
  out_shape = [jax.ShapeDtypeStruct((b, tl.n_splits), dt)
               for dt in (jnp.int32, jnp.float32, jnp.int32, jnp.float32, jnp.int32)]
  kernel = functools.partial(_kernel, k=k, vocab=v, block_v=tl.block_v, n_splits=tl.n_splits, has_q=has_q)
  n_acc, res, res_idx, pm, pm_idx = pl.pallas_call(
      kernel,
      grid=(b, tl.n_splits),
      in_specs=in_specs,
      out_specs=[scalar] * 5,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=tl.num_warps, num_stages=tl.num_stages),
      interpret=interpret,
      name="accept_sample",
  )(*args)
  # merge the splits: the first split holding the maximum (lowest vocabulary index on ties)
  pick = lambda val, at: jnp.take_along_axis(at, jnp.argmax(val, axis=1)[:, None], axis=1)[:, 0]
  n_acc = n_acc[:, 0]                                                               # [B] (same in every split)
  use_res = (n_acc < draft_len) & (jnp.max(res, axis=1) > -jnp.inf)
  token = jnp.where(use_res, pick(res, res_idx), pick(pm, pm_idx))
  return n_acc, token.astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# dispatch


SWITCH = dispatch.KernelSwitch("accept_sample", IMPL_ENV, auto_kernel=False)   # opt-in: no faster than XLA
set_impl = SWITCH.set_impl
current_impl = SWITCH.current_impl


def _probe(b, k, v, p_dtype, has_q, tiling: Tiling) -> tuple[bool, str]:
  """Kernel vs reference on random distributions of these shapes: same counts and tokens."""
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((b, k + 1, v), np.float32) * 3
  p = jnp.asarray(jax.nn.softmax(logits, axis=-1), p_dtype)
  draft = jnp.asarray(rng.integers(0, v, (b, k)), jnp.int32)
  q = jnp.asarray(jax.nn.softmax(logits[:, :k] + rng.standard_normal((b, k, v), np.float32), axis=-1),
                  p_dtype) if has_q else None
  dlen = jnp.asarray(rng.integers(0, k + 1, b), jnp.int32)
  u = jnp.asarray(rng.random((b, k), np.float32))
  g = jnp.asarray(rng.gumbel(size=(b, v)).astype(np.float32))
  got = jax.jit(functools.partial(pallas_accept_sample, tiling=tiling))(p, draft, dlen, u, g, q)
  want = jax.jit(accept_sample_reference)(p, draft, dlen, u, g, q)
  same_n = int(jnp.sum(got[0] == want[0]))
  same_tok = int(jnp.sum(got[1] == want[1]))
  return same_n == b and same_tok == b, f"{same_n}/{b} counts, {same_tok}/{b} tokens equal"


def choose(p_shape, p_dtype, has_q: bool) -> tuple[str, Tiling | None]:
  """("pallas", tiling) or ("xla", None) for these shapes under the current setting."""
  impl = SWITCH.current_impl()
  if impl == "xla":
    return impl, None
  b, k1, v = p_shape
  tiling = tiling_for(b, k1 - 1, v)
  if impl == "pallas":
    return impl, tiling
  key = (b, k1 - 1, v, jnp.dtype(p_dtype).name, has_q, tiling)
  if SWITCH.auto_serves(key, functools.partial(_probe, b, k1 - 1, v, p_dtype, has_q, tiling), log):
    return "pallas", tiling
  return "xla", None


def accept_sample(p: jax.Array, draft: jax.Array, draft_len: jax.Array, u: jax.Array, gumbel: jax.Array,
                  q: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(n_accepted [B], next_token [B]) of one chain round: the kernel or the reference."""
  impl, tiling = choose(p.shape, p.dtype, q is not None)
  if impl == "xla":
    return accept_sample_reference(p, draft, draft_len, u, gumbel, q)
  return pallas_accept_sample(p, draft, draft_len, u, gumbel, q, tiling=tiling, interpret=not dispatch.on_gpu())
