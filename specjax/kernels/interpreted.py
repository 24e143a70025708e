"""Pallas interpret mode (off a GPU) for the batch-invariant kernels.

Interpreted, a kernel's grid is an XLA while loop inside the caller's program. A loop of one step
is inlined: its block offsets become constants, and XLA compiles the body's reductions and dots
over static slices, vectorized otherwise than in the body of a loop of several steps. The same row
would then round differently computed alone (a one-step grid) and inside a larger batch. So an
interpreted grid always has at least two steps (rows padded to two blocks, a one-query attention
batch duplicated). A compiled GPU kernel is one program whatever its grid and needs none of this.
"""

from __future__ import annotations

from specjax.kernels import dispatch


def interpret_default(interpret: bool | None) -> bool:
  """`interpret` if given, else: interpret everywhere but on a GPU."""
  return (not dispatch.on_gpu()) if interpret is None else interpret


def padded_rows(m: int, block: int, interpret: bool) -> int:
  """m rows rounded up to whole blocks, and to two blocks at least when interpreted."""
  mp = -(-max(m, 1) // block) * block
  return max(mp, 2 * block) if interpret else mp
