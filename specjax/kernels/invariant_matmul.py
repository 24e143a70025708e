"""A matmul whose every output row is summed in the same order whatever the number of rows.

x [M, K] @ w [K, N] -> [M, N] float32. XLA (cuBLAS or its own Triton GEMMs) picks the algorithm
from the whole shape: a GEMV for one row, other tilings and split-K for more rows, so one row's dot
products are rounded differently when it is computed alone (a one-token decode) or inside a block
of rows (a K+1-token verification). Here the tiling is a function of the weight's shape only:

- rows are padded to a multiple of `BLOCK_M` and cut into blocks of `BLOCK_M`; a row's result
  depends on its own values only (the MMA of a tile computes each row alike, padding rows are zero);
- columns in blocks of `block_n`, the contraction in blocks of `block_k` summed in ascending order
  into a float32 accumulator;
- `n_splits` programs share the contraction of one tile (more programs for a small weight at
  batch 1); their partial sums are added in a fixed order, partial 0 first.

The float32 path multiplies in IEEE float32 (no TF32), for exactness checks.

On a GPU the kernel is lowered by Pallas to Triton; elsewhere it runs in Pallas interpret mode
(slow; tests on tiny shapes; `specjax.kernels.interpreted`). `matmul_reference` is the plain XLA
product, for comparisons.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specjax.kernels import dispatch, interpreted

BLOCK_M = 16                 # rows per program: the smallest MMA tile, fixed for every row count


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Static sizes of one weight's kernel (powers of two >= 16)."""
  block_n: int
  block_k: int
  n_splits: int            # programs over the contraction of one [BLOCK_M, block_n] tile
  num_warps: int = 4
  num_stages: int = 3


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def tiling_for(k: int, n: int, sm_count: int | None = None) -> Tiling:
  """The tiling of a [K, N] weight (N rounded up to a multiple of 16): wide column blocks when the columns alone
  give every SM a program (the LM head), else 64 columns and contraction splits until one row block
  fills about the SMs (a single row's decode reads each weight once, spread over the GPU)."""
  sms = sm_count or dispatch.sm_count()
  n = -(-n // 16) * 16
  block_n = next(bn for bn in (128, 64, 32, 16) if n % bn == 0 and (bn < 128 or n // bn >= sms))
  block_k = min(64, max(16, _pow2(k)))
  n_kb = -(-k // block_k)
  n_splits = max(1, min(n_kb, -(-sms // (n // block_n))))
  return Tiling(block_n=block_n, block_k=block_k, n_splits=n_splits)


def _kernel(x_ref, w_ref, o_ref, *, k_size: int, block_k: int, n_splits: int, transposed: bool, precision):
  """One (row block, column block, split) program.

  x_ref [BM, K]; w_ref [K, BN] (or [BN, K] when transposed); o_ref [BM, BN] float32 partial sum
  over this split's contraction blocks.
  """
  n_kb = -(-k_size // block_k)
  split = pl.program_id(2)
  lo = split * n_kb // n_splits                                                  # balanced contiguous ranges
  hi = (split + 1) * n_kb // n_splits
  ragged = k_size % block_k != 0

  def body(kb, acc):
    start = kb * block_k
    valid = (start + jnp.arange(block_k)) < k_size if ragged else None          # [BK]
    x = plgpu.load(x_ref.at[:, pl.ds(start, block_k)], mask=None if valid is None else valid[None, :],
                   other=None if valid is None else 0)                            # [BM, BK]
    if transposed:
      w = plgpu.load(w_ref.at[:, pl.ds(start, block_k)], mask=None if valid is None else valid[None, :],
                     other=None if valid is None else 0)                          # [BN, BK]
      return acc + plgpu.dot(x, w, trans_b=True, precision=precision)
    w = plgpu.load(w_ref.at[pl.ds(start, block_k), :], mask=None if valid is None else valid[:, None],
                   other=None if valid is None else 0)                            # [BK, BN]
    return acc + plgpu.dot(x, w, precision=precision)

  bm, bn = o_ref.shape
  plgpu.store(o_ref, lax.fori_loop(lo, hi, body, jnp.zeros((bm, bn), jnp.float32)))


def pallas_matmul(x: jax.Array, w: jax.Array, *, transposed: bool = False, tiling: Tiling | None = None,
                  interpret: bool | None = None) -> jax.Array:
  """x [..., K] @ w [K, N] (or w [N, K] with `transposed`) -> [..., N] float32, row-invariant.

  x is cast to w's dtype; N must be a multiple of 16 (other widths are padded with zero columns,
  a copy of the weight per call)."""
  *lead, k = x.shape
  n = w.shape[0] if transposed else w.shape[1]
  if n % 16:
    pad = 16 - n % 16
    w = jnp.pad(w, ((0, pad), (0, 0)) if transposed else ((0, 0), (0, pad)))
    return pallas_matmul(x, w, transposed=transposed, tiling=tiling, interpret=interpret)[..., :n]
  tl = tiling or tiling_for(k, n)
  rows = x.reshape(-1, k).astype(w.dtype)                                        # [M, K]
  m = rows.shape[0]
  interpret = interpreted.interpret_default(interpret)
  mp = interpreted.padded_rows(m, BLOCK_M, interpret)
  rows = jnp.pad(rows, ((0, mp - m), (0, 0)))                                    # [Mp, K] zero rows
  precision = lax.Precision.HIGHEST if w.dtype == jnp.float32 else None          # float32: IEEE, no TF32
  kernel = functools.partial(_kernel, k_size=k, block_k=tl.block_k, n_splits=tl.n_splits,
                             transposed=transposed, precision=precision)
  w_spec = (pl.BlockSpec((tl.block_n, k), lambda i, j, s: (j, 0)) if transposed
            else pl.BlockSpec((k, tl.block_n), lambda i, j, s: (0, j)))
  parts = pl.pallas_call(
      kernel,
      # row blocks vary fastest: consecutive programs read the same weight tile (served from L2)
      grid=(mp // BLOCK_M, n // tl.block_n, tl.n_splits),
      in_specs=[pl.BlockSpec((BLOCK_M, k), lambda i, j, s: (i, 0)), w_spec],
      out_specs=pl.BlockSpec((None, BLOCK_M, tl.block_n), lambda i, j, s: (s, i, j)),
      out_shape=jax.ShapeDtypeStruct((tl.n_splits, mp, n), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=tl.num_warps, num_stages=tl.num_stages),
      interpret=interpret,
      name="invariant_matmul",
  )(rows, w)                                                                     # [S, Mp, N]
  out = parts[0]
  for s in range(1, tl.n_splits):   # a fixed order of elementwise adds (XLA does not reassociate them)
    out = out + parts[s]
  return out[:m].reshape(*lead, n)


def matmul_reference(x: jax.Array, w: jax.Array, *, transposed: bool = False) -> jax.Array:
  """The XLA product the kernel replaces: x [..., K] @ w -> [..., N] float32."""
  spec = "...k,nk->...n" if transposed else "...k,kn->...n"
  return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)
