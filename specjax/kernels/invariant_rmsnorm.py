"""RMSNorm whose every row is reduced in the same order whatever the number of rows.

XLA chooses a reduction's thread layout and vectorization from the whole shape, so a row's sum of
squares is not guaranteed to round alike in a [1, D] and a [K+1, D] normalization. This kernel
reduces fixed tiles of `BLOCK_ROWS` rows x D (padded to a power of two with zeros): every row of
every tile is reduced by the same code, so a row's result depends on its own values only.

y = x * rsqrt(mean(x^2) + eps) * w, or * (1 + w) with `offset` (Gemma), computed in float32 and
returned in x's dtype, as `specjax.models.layers.RMSNorm`. On a GPU the kernel is lowered by
Pallas to Triton; elsewhere it runs in Pallas interpret mode (`specjax.kernels.interpreted`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specjax.kernels import interpreted

BLOCK_ROWS = 4            # rows per program: a [4, D] float32 tile stays in registers for D up to a few thousand


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _kernel(x_ref, w_ref, o_ref, *, dim: int, eps: float, offset: bool):
  """x_ref [BR, D], w_ref [D], o_ref [BR, D]: one tile of rows."""
  dp = _pow2(dim)
  cols = jnp.arange(dp)
  valid = cols < dim if dp != dim else None                                      # [DP]
  x = plgpu.load(x_ref.at[:, pl.ds(0, dp)], mask=None if valid is None else valid[None, :],
                 other=None if valid is None else 0).astype(jnp.float32)          # [BR, DP]
  w = plgpu.load(w_ref.at[pl.ds(0, dp)], mask=valid, other=None if valid is None else 0).astype(jnp.float32)
  if offset:
    w = 1.0 + w
  ms = jnp.sum(x * x, axis=1) / dim                                               # [BR]
  y = x * lax.rsqrt(ms + eps)[:, None] * w[None, :]
  plgpu.store(o_ref.at[:, pl.ds(0, dp)], y.astype(o_ref.dtype), mask=None if valid is None else valid[None, :])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, offset: bool = False,
             interpret: bool | None = None) -> jax.Array:
  """x [..., D], weight [D] -> [..., D] in x's dtype, row-invariant."""
  *lead, d = x.shape
  rows = x.reshape(-1, d)
  m = rows.shape[0]
  interpret = interpreted.interpret_default(interpret)
  mp = interpreted.padded_rows(m, BLOCK_ROWS, interpret)
  rows = jnp.pad(rows, ((0, mp - m), (0, 0)))                                    # [Mp, D] zero rows
  out = pl.pallas_call(
      functools.partial(_kernel, dim=d, eps=float(eps), offset=offset),
      grid=(mp // BLOCK_ROWS,),
      in_specs=[pl.BlockSpec((BLOCK_ROWS, d), lambda i: (i, 0)), pl.BlockSpec((d,), lambda i: (0,))],
      out_specs=pl.BlockSpec((BLOCK_ROWS, d), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((mp, d), x.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="invariant_rmsnorm",
  )(rows, weight)                                                                # [Mp, D]
  return out[:m].reshape(*lead, d)
