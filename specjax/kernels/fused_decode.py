"""Fused kernels of a decoder layer for decode and small verification steps.

A decode step of a small model at batch 1 is bound by kernel launches, not by bytes: SmolLM2-135M
reads 270 MB of bf16 weights per step (well under 0.1 ms at GPU memory bandwidth) but takes ~1.25 ms, launching XLA
kernels for every piece of a layer (norm, GEMM, bias, rotary, residual adds, activation), 30
layers a step. Outside
attention these kernels do a layer in four launches, for M = batch x new tokens rows (at most
`MAX_ROWS` where they are used):

- `norm_qkv_rope`: RMSNorm of the rows, the fused q / k / v projection (+ bias), the per-head
  QK-norm when the model has one, and the rotary embedding of q and k;
- `matmul_residual`: residual + h @ w (+ bias), for o_proj and down_proj;
- `norm_gate_up`: RMSNorm of the rows, the fused gate / up projection and act(gate) * up.

Every grid runs over output column blocks (and row blocks of at most 64 rows). Each program reads
all of its rows and recomputes their norm (M x d reads beside the d x block weight tile it
streams), and owns its output tile: its whole contraction is summed in one ascending loop into a
float32 accumulator. No split-K across programs, no atomics: results are deterministic.

The fused column layouts are those of `specjax.models.layers` (`qkv_layout`, `gate_up_layout`).
q / k / v: heads of D contiguous columns, G + 2 per KV head (its G query heads, K_g, V_g), so head
u is a query head when u % (G + 2) < G, a key head when it equals G, else a value head. Rotary
pairs column c of a head with c + D/2: a program takes a block of columns of each half of one head
(two dots) and rotates them in registers. gate / up: gate_j, up_j rows side by side; seen as
[F, 2, d] (a free reshape) a program loads the gate and up rows of the same units as two strided
tiles. Weights are [out, in] (`layers.Linear`): every tile is a block of output rows, each row's
contraction contiguous in memory.

Triton needs power-of-two tiles: widths that are not (SmolLM2's 576, 1536) are covered by masked
loads and stores, never by padded weights. Numerics follow `layers.Linear` / `RMSNorm` / `rope`:
norms and rotary in float32, the matmul input rounded to the weight dtype, float32 accumulation
(IEEE float32, no TF32, with float32 weights). Off a GPU the kernels run in Pallas interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specjax.kernels import dispatch, interpreted

MAX_ROWS = 64             # the fused layer serves steps of at most this many rows (decode, verification)
ACTIVATIONS = ("silu", "gelu_tanh")
TILINGS_ENV = "SPECJAX_FUSED_TILINGS"   # a JSON tiling table (`tuned_tiling`) used instead of the packaged one
TILINGS_FILE = Path(__file__).with_name("fused_tilings.json")


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Static sizes of one kernel call (powers of two; >= 16 but block_m 1 for the one-row product)."""
  block_m: int            # rows per program
  block_n: int            # output columns per program (per half-head for `norm_qkv_rope`, per part for gate / up)
  block_k: int            # contraction per loop step
  num_warps: int = 4
  num_stages: int = 3
  dot: bool = True        # tensor-core dot over a block of rows; False: one row (block_m 1), multiply + column sums
  unroll: bool = False    # the contraction's blocks unrolled, every block's loads issued before the first is used

  @classmethod
  def from_dict(cls, d: dict) -> "Tiling":
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def _pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def tiling_for(m: int, n: int, *, widest: int = 128, sm_count: int | None = None) -> Tiling:
  """Tiles for M rows and N output columns (units of a program's width): the widest column block
  (up to `widest`) that still gives every SM a program, else 16 columns (the most programs).
  Decode reads each weight once; spreading it over the SMs is what makes the read fast."""
  sms = sm_count or dispatch.sm_count()
  block_m = min(64, max(16, _pow2(m)))
  widths = [bn for bn in (128, 64, 32, 16) if bn <= max(16, widest)]
  block_n = next((bn for bn in widths if _cdiv(n, bn) >= sms), widths[-1])
  return Tiling(block_m=block_m, block_n=block_n, block_k=128 if block_m <= 16 else 64)


def _contract(x, w, *, dot: bool, precision):
  """[BM, BN] float32 partial product of x [BM, BK] (weight dtype) and a weight tile w [BN, BK] (the
  weights are stored [out, in], `layers.Linear`): a tensor-core dot, or for one row (BM 1) the
  elementwise product summed along each weight row's contiguous contraction in float32."""
  if dot:
    return plgpu.dot(x, w, trans_b=True, precision=precision)
  return jnp.sum(x.astype(jnp.float32) * w.astype(jnp.float32), axis=1)[None, :]


def _check_tiling(tl: Tiling) -> None:
  if not tl.dot and tl.block_m != 1:
    raise ValueError(f"{tl}: the multiply-and-sum product (dot=False) takes one row per program (block_m 1)")
  if tl.dot and tl.block_m < 16:
    raise ValueError(f"{tl}: a tensor-core dot needs block_m >= 16")


def tiling_key(kernel: str, m: int, n: int, k: int) -> str:
  """A tiling table's key: kernel name, rows rounded up to a power of two, output and contraction widths."""
  return f"{kernel} m{_pow2(m)} n{n} k{k}"


@functools.lru_cache(maxsize=None)
def _tiling_table(path: str, device_kind: str) -> dict:
  p = Path(path)
  tables = json.loads(p.read_text()) if p.is_file() else {}
  return tables.get(device_kind, {})


def tuned_tiling(kernel: str, m: int, n: int, k: int) -> Tiling | None:
  """The measured best tiling of this kernel and shape on this device, if a table has it.

  Tables map a device kind (`jax.devices()[0].device_kind`) to {`tiling_key`: Tiling fields}:
  $SPECJAX_FUSED_TILINGS when set, else `fused_tilings.json` beside this file (the tilings
  `experiments/fused_tiling_sweep.py` measured fastest on the cards we have run). None: no entry,
  `tiling_for`'s rule applies."""
  try:
    kind = jax.devices()[0].device_kind
  except Exception:   # noqa: BLE001 - no device
    return None
  entry = _tiling_table(os.environ.get(TILINGS_ENV) or str(TILINGS_FILE), kind).get(tiling_key(kernel, m, n, k))
  return Tiling.from_dict(entry) if entry else None


def _precision(w_dtype):
  return lax.Precision.HIGHEST if jnp.dtype(w_dtype) == jnp.float32 else None   # float32: IEEE, no TF32


def _row_mask(m: int, bm: int):
  """(first row of this program's row block, [BM] bool row < M)."""
  row0 = pl.program_id(0) * bm
  return row0, (row0 + jnp.arange(bm)) < m


def _inv_rms(x_ref, row0, row_ok, *, d: int, bk: int, eps: float):
  """[BM] float32 1 / rms of this program's rows of x_ref [M, d] (sum of squares over d / d)."""
  bm = row_ok.shape[0]

  def body(kb, ss):
    k0 = kb * bk
    ok = row_ok[:, None] & ((k0 + jnp.arange(bk)) < d)[None, :]
    x = plgpu.load(x_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], mask=ok, other=0).astype(jnp.float32)   # [BM, BK]
    return ss + jnp.sum(x * x, axis=1)
  ss = lax.fori_loop(0, _cdiv(d, bk), body, jnp.zeros((bm,), jnp.float32))
  return lax.rsqrt(ss / d + eps)


def _normed_tile(x_ref, nw_ref, row0, row_ok, inv, k0, *, d: int, bk: int, offset: bool, dtype, x=None, nw=None):
  """Rows [BM, BK] of x at contraction offset k0, normed (x * inv_rms * w, float32) then rounded to
  the weight dtype as `Linear` rounds its input; zero past d. Also returns the [BK] validity.
  `x`, `nw`: the x tile and the norm weights' [BK] block already loaded."""
  bm = row_ok.shape[0]
  k_ok = (k0 + jnp.arange(bk)) < d                                                # [BK]
  if x is None:
    x = plgpu.load(x_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], mask=row_ok[:, None] & k_ok[None, :],
                   other=0).astype(jnp.float32)                                   # [BM, BK]
  if nw is None:
    nw = plgpu.load(nw_ref.at[pl.ds(k0, bk)], mask=k_ok, other=0)
  w = nw.astype(jnp.float32)                                                      # [BK]
  if offset:
    w = 1.0 + w
  return ((x * inv[:, None]) * w[None, :]).astype(dtype), k_ok


def _block_starts(n_blocks: int, bk: int):
  """Start offsets of an unrolled contraction's blocks as traced values (block kb at kb * bk): the
  last block may run past the array's end under its mask, which Pallas refuses for constant starts
  but allows for traced ones, as in a loop. The added zero is folded away by the compiler."""
  zero = pl.program_id(0) * 0
  return [zero + kb * bk for kb in range(n_blocks)]


def _normed_rows(x_ref, nw_ref, row0, row_ok, *, d: int, bk: int, eps: float, offset: bool, dtype, load_of,
                 contract_of, unroll: bool):
  """The normed rows' contraction: acc -> acc + sum over contraction blocks of
  `contract_of(xn_tile, load_of(k0, k_ok), acc)` (`load_of` loads a block's weight tiles).

  Unrolled (or one block covering d): every x block and every weight block is loaded first, then the
  norm's sum of squares and the products use them, so the program waits for memory about once rather
  than once per block. Otherwise two loops: the norm's, then the product's."""
  n_blocks = _cdiv(d, bk)
  if unroll or n_blocks == 1:
    bm = row_ok.shape[0]
    starts = _block_starts(n_blocks, bk)
    oks = [(kb * bk + jnp.arange(bk)) < d for kb in range(n_blocks)]                # [BK] each
    xs = [plgpu.load(x_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], mask=row_ok[:, None] & ok[None, :],
                     other=0).astype(jnp.float32) for k0, ok in zip(starts, oks)]  # [BM, BK] each
    nws = [plgpu.load(nw_ref.at[pl.ds(k0, bk)], mask=ok, other=0) for k0, ok in zip(starts, oks)]   # [BK] each
    tiles = [load_of(k0, ok) for k0, ok in zip(starts, oks)]
    inv = lax.rsqrt(sum(jnp.sum(x * x, axis=1) for x in xs) / d + eps)          # [BM]

    def unrolled(acc):
      for kb in range(n_blocks):
        xn, _ = _normed_tile(x_ref, nw_ref, row0, row_ok, inv, starts[kb], d=d, bk=bk, offset=offset, dtype=dtype,
                             x=xs[kb], nw=nws[kb])
        acc = contract_of(xn, tiles[kb], acc)
      return acc
    return unrolled
  inv = _inv_rms(x_ref, row0, row_ok, d=d, bk=bk, eps=eps)                        # [BM]

  def loop(init):
    def body(kb, acc):
      k0 = kb * bk
      xn, k_ok = _normed_tile(x_ref, nw_ref, row0, row_ok, inv, k0, d=d, bk=bk, offset=offset, dtype=dtype)
      return contract_of(xn, load_of(k0, k_ok), acc)
    return lax.fori_loop(0, n_blocks, body, init)
  return loop


# ----------------------------------------------------------------------------------------------
# RMSNorm + q / k / v projection (+ bias, + QK-norm) + rotary


def _qkv_kernel(*refs, m: int, d: int, eps: float, offset: bool, head_dim: int, group: int, bm: int, bh: int,
                bk: int, has_bias: bool, qk_norm: bool, qk_eps: float, qk_offset: bool, precision, dot: bool,
                unroll: bool):
  """One (row block, head chunk) program: columns [c, c + BH) of both halves of one head.

  x_ref [M, d] f32; nw_ref [d]; w_ref [N, d]; cos_ref, sin_ref [M, D/2] f32; (b_ref [N]);
  (qn_ref, kn_ref [D]); o_ref [M, N] f32.
  """
  x_ref, nw_ref, w_ref, cos_ref, sin_ref, *rest, o_ref = refs
  b_ref = rest.pop(0) if has_bias else None
  qn_ref, kn_ref = rest if qk_norm else (None, None)
  half = head_dim // 2
  chunks = half // bh
  head, c = pl.program_id(1) // chunks, pl.program_id(1) % chunks
  col_a = head * head_dim + c * bh                                                # first half's columns
  col_b = col_a + half                                                            # their rotary partners
  row0, row_ok = _row_mask(m, bm)

  def load_of(k0, k_ok):   # [BH, BK] weight tiles of both halves
    return (plgpu.load(w_ref.at[pl.ds(col_a, bh), pl.ds(k0, bk)], mask=k_ok[None, :], other=0),
            plgpu.load(w_ref.at[pl.ds(col_b, bh), pl.ds(k0, bk)], mask=k_ok[None, :], other=0))

  def contract_of(xn, tiles, acc):
    (wa, wb), (a, b) = tiles, acc
    return a + _contract(xn, wa, dot=dot, precision=precision), b + _contract(xn, wb, dot=dot, precision=precision)
  zeros = jnp.zeros((bm, bh), jnp.float32)
  a, b = _normed_rows(x_ref, nw_ref, row0, row_ok, d=d, bk=bk, eps=eps, offset=offset, dtype=w_ref.dtype,
                      load_of=load_of, contract_of=contract_of, unroll=unroll)((zeros, zeros))   # [BM, BH] each
  if has_bias:
    a = a + plgpu.load(b_ref.at[pl.ds(col_a, bh)]).astype(jnp.float32)[None, :]
    b = b + plgpu.load(b_ref.at[pl.ds(col_b, bh)]).astype(jnp.float32)[None, :]
  kind = head % (group + 2)                                                       # < G: q, G: k, G + 1: v
  rotated = kind <= group
  if qk_norm:   # the program holds the whole head (BH = D/2): RMSNorm over its D columns
    inv_h = lax.rsqrt((jnp.sum(a * a, axis=1) + jnp.sum(b * b, axis=1)) / head_dim + qk_eps)[:, None]   # [BM, 1]
    is_k = kind == group
    wa_n = jnp.where(is_k, plgpu.load(kn_ref.at[pl.ds(0, half)]), plgpu.load(qn_ref.at[pl.ds(0, half)]))
    wb_n = jnp.where(is_k, plgpu.load(kn_ref.at[pl.ds(half, half)]), plgpu.load(qn_ref.at[pl.ds(half, half)]))
    wa_n, wb_n = wa_n.astype(jnp.float32), wb_n.astype(jnp.float32)               # [BH]
    if qk_offset:
      wa_n, wb_n = 1.0 + wa_n, 1.0 + wb_n
    a = jnp.where(rotated, (a * inv_h) * wa_n[None, :], a)
    b = jnp.where(rotated, (b * inv_h) * wb_n[None, :], b)
  rows = pl.ds(row0, bm)
  cos = plgpu.load(cos_ref.at[rows, pl.ds(c * bh, bh)], mask=row_ok[:, None], other=0)   # [BM, BH]
  sin = plgpu.load(sin_ref.at[rows, pl.ds(c * bh, bh)], mask=row_ok[:, None], other=0)
  a_out = jnp.where(rotated, a * cos - b * sin, a)                                # rotate-half, as `layers.rope`
  b_out = jnp.where(rotated, b * cos + a * sin, b)
  plgpu.store(o_ref.at[rows, pl.ds(col_a, bh)], a_out, mask=row_ok[:, None])
  plgpu.store(o_ref.at[rows, pl.ds(col_b, bh)], b_out, mask=row_ok[:, None])


def norm_qkv_rope(x: jax.Array, norm_w: jax.Array, w: jax.Array, cos: jax.Array, sin: jax.Array, *,
                  eps: float, offset: bool, n_heads: int, n_kv_heads: int, head_dim: int,
                  bias: jax.Array | None = None, q_norm: jax.Array | None = None, k_norm: jax.Array | None = None,
                  qk_eps: float = 1e-6, qk_offset: bool = False, tiling: Tiling | None = None,
                  interpret: bool | None = None) -> jax.Array:
  """rope(qkv(rms_norm(x))) in the fused column layout (`layers.qkv_layout`): q and k rotated, v not.

  x [M, d] float32 rows; norm_w [d]; w [(H+2KVH)*D, d] ([out, in]); cos, sin [M, D/2] float32 (this row's
  rotary angles, `layers.rope`'s); bias [(H+2KVH)*D]; q_norm / k_norm [D] (QK-norm, both or
  neither). -> [M, (H+2KVH)*D] float32 (`layers.split_qkv` cuts it into q, k, v).
  """
  m, d = x.shape
  n = w.shape[0]
  if w.shape[1] != d or n != (n_heads + 2 * n_kv_heads) * head_dim or n_heads % n_kv_heads:
    raise ValueError(f"qkv weight {w.shape} does not hold {n_heads} + 2 x {n_kv_heads} heads of {head_dim}")
  if head_dim != _pow2(head_dim) or head_dim < 32:
    raise ValueError(f"head_dim {head_dim}: the kernel needs a power of two >= 32")
  qk_norm = q_norm is not None
  tl = tiling or tuned_tiling("norm_qkv_rope", m, n, d) or tiling_for(m, n // 2, widest=head_dim // 2)
  _check_tiling(tl)
  bh = head_dim // 2 if qk_norm else min(tl.block_n, head_dim // 2)   # QK-norm needs a whole head per program
  inputs = [x, norm_w, w, cos, sin] + ([bias] if bias is not None else []) + ([q_norm, k_norm] if qk_norm else [])
  kernel = functools.partial(
      _qkv_kernel, m=m, d=d, eps=float(eps), offset=offset, head_dim=head_dim, group=n_heads // n_kv_heads,
      bm=tl.block_m, bh=bh, bk=tl.block_k, has_bias=bias is not None, qk_norm=qk_norm, qk_eps=float(qk_eps),
      qk_offset=qk_offset, precision=_precision(w.dtype), dot=tl.dot, unroll=tl.unroll)
  return pl.pallas_call(
      kernel,
      grid=(_cdiv(m, tl.block_m), n // (2 * bh)),
      out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=tl.num_warps, num_stages=tl.num_stages),
      interpret=interpreted.interpret_default(interpret),
      name="norm_qkv_rope",
  )(*inputs)


# ----------------------------------------------------------------------------------------------
# residual + matmul (+ bias)


def _residual_kernel(*refs, m: int, k_size: int, n: int, bm: int, bn: int, bk: int, has_bias: bool, precision,
                     dot: bool, unroll: bool):
  """One (row block, column block) program. h_ref [M, K]; w_ref [N, K]; r_ref [M, N] float32;
  (b_ref [N]); o_ref [M, N] float32."""
  h_ref, w_ref, r_ref, *rest, o_ref = refs
  row0, row_ok = _row_mask(m, bm)
  col0 = pl.program_id(1) * bn
  col_ok = (col0 + jnp.arange(bn)) < n                                            # [BN]

  def load(k0):   # h [BM, BK] and w [BN, BK] of one contraction block
    k_ok = (k0 + jnp.arange(bk)) < k_size                                         # [BK]
    return (plgpu.load(h_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], mask=row_ok[:, None] & k_ok[None, :], other=0),
            plgpu.load(w_ref.at[pl.ds(col0, bn), pl.ds(k0, bk)], mask=col_ok[:, None] & k_ok[None, :], other=0))

  def contract_of(tiles, acc):
    h, wt = tiles
    return acc + _contract(h.astype(w_ref.dtype), wt, dot=dot, precision=precision)   # [BM, BN]
  zeros = jnp.zeros((bm, bn), jnp.float32)
  steps = _cdiv(k_size, bk)
  if unroll or steps == 1:   # every block's loads issued before the first product
    y = zeros
    for tiles in [load(k0) for k0 in _block_starts(steps, bk)]:
      y = contract_of(tiles, y)
  else:
    y = lax.fori_loop(0, steps, lambda kb, acc: contract_of(load(kb * bk), acc), zeros)
  if has_bias:
    y = y + plgpu.load(rest[0].at[pl.ds(col0, bn)], mask=col_ok, other=0).astype(jnp.float32)[None, :]
  tile = (pl.ds(row0, bm), pl.ds(col0, bn))
  ok = row_ok[:, None] & col_ok[None, :]
  res = plgpu.load(r_ref.at[tile], mask=ok, other=0)                              # [BM, BN] f32
  plgpu.store(o_ref.at[tile], res + y, mask=ok)


def matmul_residual(h: jax.Array, w: jax.Array, residual: jax.Array, bias: jax.Array | None = None, *,
                    tiling: Tiling | None = None, interpret: bool | None = None) -> jax.Array:
  """residual + (h @ w.T (+ bias)): h [M, K] (rounded to w's dtype); w [N, K] ([out, in]); residual
  [M, N] float32; bias [N]. -> [M, N] float32, the layer's residual stream after o_proj or down_proj."""
  m, k = h.shape
  n = w.shape[0]
  if w.shape[1] != k:
    raise ValueError(f"weight {w.shape} does not take rows of {k}")
  tl = tiling or tuned_tiling("matmul_residual", m, n, k) or tiling_for(m, n)
  _check_tiling(tl)
  inputs = [h, w, residual] + ([bias] if bias is not None else [])
  kernel = functools.partial(_residual_kernel, m=m, k_size=k, n=n, bm=tl.block_m, bn=tl.block_n, bk=tl.block_k,
                             has_bias=bias is not None, precision=_precision(w.dtype), dot=tl.dot,
                             unroll=tl.unroll)
  return pl.pallas_call(
      kernel,
      grid=(_cdiv(m, tl.block_m), _cdiv(n, tl.block_n)),
      out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=tl.num_warps, num_stages=tl.num_stages),
      interpret=interpreted.interpret_default(interpret),
      name="matmul_residual",
  )(*inputs)


# ----------------------------------------------------------------------------------------------
# RMSNorm + gate / up projection + act(gate) * up


def _gate_up_kernel(x_ref, nw_ref, w_ref, o_ref, *, m: int, d: int, f: int, eps: float, offset: bool,
                    activation: str, bm: int, bf: int, bk: int, precision, dot: bool, unroll: bool):
  """One (row block, unit block) program. x_ref [M, d] f32; nw_ref [d]; w_ref [F, 2, d] (gate_j,
  up_j rows side by side); o_ref [M, F]."""
  row0, row_ok = _row_mask(m, bm)
  u0 = pl.program_id(1) * bf
  unit_ok = (u0 + jnp.arange(bf)) < f                                             # [BF]

  def load_of(k0, k_ok):   # [BF, BK] gate and up rows
    ok = unit_ok[:, None] & k_ok[None, :]
    return (plgpu.load(w_ref.at[pl.ds(u0, bf), jnp.int32(0), pl.ds(k0, bk)], mask=ok, other=0),
            plgpu.load(w_ref.at[pl.ds(u0, bf), jnp.int32(1), pl.ds(k0, bk)], mask=ok, other=0))

  def contract_of(xn, tiles, acc):
    (wg, wu), (g, u) = tiles, acc
    return g + _contract(xn, wg, dot=dot, precision=precision), u + _contract(xn, wu, dot=dot, precision=precision)
  zeros = jnp.zeros((bm, bf), jnp.float32)
  g, u = _normed_rows(x_ref, nw_ref, row0, row_ok, d=d, bk=bk, eps=eps, offset=offset, dtype=w_ref.dtype,
                      load_of=load_of, contract_of=contract_of, unroll=unroll)((zeros, zeros))   # [BM, BF] each
  g = jax.nn.silu(g) if activation == "silu" else jax.nn.gelu(g, approximate=True)
  plgpu.store(o_ref.at[pl.ds(row0, bm), pl.ds(u0, bf)], (g * u).astype(o_ref.dtype),
              mask=row_ok[:, None] & unit_ok[None, :])


def norm_gate_up(x: jax.Array, norm_w: jax.Array, w: jax.Array, *, eps: float, offset: bool,
                 activation: str = "silu", tiling: Tiling | None = None,
                 interpret: bool | None = None) -> jax.Array:
  """act(gate) * up of rms_norm(x) (`layers.MLP` before down_proj).

  x [M, d] float32 rows; norm_w [d]; w [2F, d] ([out, in]) in the fused layout
  (`layers.gate_up_layout`: gate_j, up_j rows side by side). -> [M, F] in w's dtype (down_proj rounds
  its input to it anyway).
  """
  if activation not in ACTIVATIONS:
    raise ValueError(f"activation {activation!r}: the kernel has {ACTIVATIONS}")
  m, d = x.shape
  f = w.shape[0] // 2
  if w.shape != (2 * f, d):
    raise ValueError(f"gate / up weight {w.shape} is not [2F, {d}]")
  tl = tiling or tuned_tiling("norm_gate_up", m, 2 * f, d) or tiling_for(m, f)
  _check_tiling(tl)
  kernel = functools.partial(_gate_up_kernel, m=m, d=d, f=f, eps=float(eps), offset=offset, activation=activation,
                             bm=tl.block_m, bf=tl.block_n, bk=tl.block_k, precision=_precision(w.dtype), dot=tl.dot,
                             unroll=tl.unroll)
  return pl.pallas_call(
      kernel,
      grid=(_cdiv(m, tl.block_m), _cdiv(f, tl.block_n)),
      out_shape=jax.ShapeDtypeStruct((m, f), w.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=tl.num_warps, num_stages=tl.num_stages),
      interpret=interpreted.interpret_default(interpret),
      name="norm_gate_up",
  )(x, norm_w, w.reshape(f, 2, d))
