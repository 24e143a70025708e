"""Moving a tree round's accepted path into consecutive cache slots in one kernel launch.

After a tree round the accepted path's keys and values sit at scattered slots base + src[:, j]
(src [B, D+1]: 0 for the root, 1 + the node's index along the path) and belong at base + j, where
a plain decode would have written them (`engine.tree.compact_path`). XLA runs that move as a gather
and a scatter per layer for K and again for V: 2 x n_layers kernels or more, each a few kilobytes
at the GPU's launch floor. `pallas_compact` moves every array in one Pallas (Triton) kernel:
program (sequence, KV head, array) reads the path's rows of its array, then writes them (all
reads first, so the move is the reference's whatever the path; programs touch disjoint slices).
As in the XLA reference, a source past the capacity reads the last slot (gather clamps) and a
target past it is dropped (scatter mode "drop").

`compact` dispatches: SPECJAX_COMPACT_PATH=pallas runs the kernel (Pallas interpret mode off a
GPU), xla the XLA reference; auto (the default) runs the kernel on a GPU for shapes whose probe
matched the reference, the reference elsewhere (its speed against XLA: experiments/bench_compact_path.py).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specjax.kernels import dispatch

IMPL_ENV = "SPECJAX_COMPACT_PATH"     # auto (default) | pallas | xla

log = logging.getLogger(__name__)


def compact_reference(arrays: tuple[jax.Array, ...], base: jax.Array, src: jax.Array) -> tuple[jax.Array, ...]:
  """Every array [B, S, KVH, hd]: slot base + j <- slot base + src[:, j] (base [B], src [B, D+1])."""
  rows = jnp.arange(base.shape[0])[:, None]                                          # [B, 1]
  from_slots = base[:, None] + src                                                    # [B, D+1]
  to_slots = base[:, None] + jnp.arange(src.shape[1])[None, :]                        # [B, D+1]
  return tuple(x.at[rows, to_slots].set(x[rows, from_slots], mode="drop") for x in arrays)


def _kernel(*refs, n_arrays: int, n_rows: int, capacity: int):
  """refs: base [], the source slot of rows 1..n_rows-1 (each []), n_arrays inputs [S, hd] (this
  sequence and head), the same n_arrays as outputs (aliased to the inputs)."""
  base_ref, from_refs = refs[0], refs[1:n_rows]
  ins, outs = refs[n_rows:n_rows + n_arrays], refs[n_rows + n_arrays:]
  base = base_ref[()]
  sources = [jnp.minimum(r[()], capacity - 1) for r in from_refs]                    # row 0 (the root) stays
  for a in range(n_arrays):
    @pl.when(pl.program_id(2) == a)
    def _move(a=a):
      rows = [plgpu.load(ins[a].at[pl.ds(s, 1), :]) for s in sources]                 # [1, hd] each, all read first
      for j, row in enumerate(rows, start=1):
        to = base + j
        plgpu.store(outs[a].at[pl.ds(to, 1), :], row, mask=jnp.full(row.shape, to < capacity))


def pallas_compact(arrays: tuple[jax.Array, ...], base: jax.Array, src: jax.Array, *,
                   interpret: bool = False) -> tuple[jax.Array, ...]:
  """Same result as `compact_reference` (same arguments; every array of one shape and dtype)."""
  b, s_cap, kvh, hd = arrays[0].shape
  n, n_rows = len(arrays), src.shape[1]
  if n_rows < 2:
    return tuple(arrays)
  base = base.astype(jnp.int32)
  from_slots = [base + src[:, j].astype(jnp.int32) for j in range(1, n_rows)]        # [B] each
  scalar = pl.BlockSpec((None,), lambda i, h, a: (i,))
  tile = pl.BlockSpec((None, s_cap, None, hd), lambda i, h, a: (i, 0, h, 0))
  first = n_rows                                                                      # operands before the arrays
  out = pl.pallas_call(
      functools.partial(_kernel, n_arrays=n, n_rows=n_rows, capacity=s_cap),
      grid=(b, kvh, n),
      in_specs=[scalar] * n_rows + [tile] * n,
      out_specs=[tile] * n,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays],
      input_output_aliases={first + i: i for i in range(n)},
      compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
      interpret=interpret,
      name="compact_path",
  )(base, *from_slots, *arrays)
  return tuple(out)


# ----------------------------------------------------------------------------------------------
# dispatch


SWITCH = dispatch.KernelSwitch("compact_path", IMPL_ENV)
set_impl = SWITCH.set_impl
current_impl = SWITCH.current_impl


def _probe(n, b, s_cap, kvh, hd, n_rows, dtype) -> tuple[bool, str]:
  """Kernel vs reference on random arrays and paths of these shapes: bitwise equal (a copy)."""
  rng = np.random.default_rng(0)
  arrays = tuple(jnp.asarray(rng.standard_normal((b, s_cap, kvh, hd), np.float32), dtype) for _ in range(n))
  base = jnp.asarray(rng.integers(0, s_cap - n_rows, b), jnp.int32)
  src = jnp.asarray(np.concatenate([np.zeros((b, 1), np.int64),
                                    np.sort(rng.integers(1, 2 * n_rows, (b, n_rows - 1)), axis=1)], axis=1), jnp.int32)
  src = jnp.maximum(src, jnp.arange(n_rows)[None, :])
  got = jax.jit(pallas_compact)(arrays, base, src)
  want = jax.jit(compact_reference)(arrays, base, src)
  same = sum(bool(jnp.array_equal(g, w)) for g, w in zip(got, want))
  return same == n, f"{same}/{n} arrays equal"


def compact(arrays: tuple[jax.Array, ...], base: jax.Array, src: jax.Array) -> tuple[jax.Array, ...]:
  """The move of `compact_reference`: the kernel or the reference (see the module docstring)."""
  impl = SWITCH.current_impl()
  shapes = {(x.shape, x.dtype) for x in arrays}
  if impl == "xla" or len(shapes) != 1 or src.shape[1] < 2:
    return compact_reference(arrays, base, src)
  if impl == "auto":
    (shape, dtype), = shapes
    key = (len(arrays), *shape, src.shape[1], jnp.dtype(dtype).name)
    if not SWITCH.auto_serves(key, functools.partial(_probe, len(arrays), *shape, src.shape[1], dtype), log):
      return compact_reference(arrays, base, src)
  return pallas_compact(arrays, base, src, interpret=not dispatch.on_gpu())
