"""Tilings of the fused decode kernels (specjax/kernels/fused_decode.py), each timed alone, beside XLA.

  OUT=... bash experiments/gpu/bootstrap.sh python experiments/fused_tiling_sweep.py --out $OUT/sweep.json \
      --table-out $OUT/fused_tilings.json
  python experiments/fused_tiling_sweep.py --tiny --out /tmp/sweep.json --table-out /tmp/t.json   # CPU dry run

For SmolLM2-135M's layer shapes (d_model 576, 9 / 3 heads of 64, ffn 1536; random bf16 weights) and
each row count of --rows (batch x new tokens of a decode or verification step), the four kernels of
a fused layer: `norm_qkv_rope` (576 -> 960), `matmul_residual` as o_proj (576 -> 576) and as
down_proj (1536 -> 576), `norm_gate_up` (576 -> 2 x 1536). Every tiling of the grid (tensor-core
dots over 16-row blocks; for one row also the multiply-and-sum product; column widths, contraction
steps (one step: the whole contraction in one load; unrolled: every block loaded first), warps and
pipeline stages) runs --steps
dependent calls inside one jitted fori_loop (its output feeds the next call's input, as the layers
of a step feed each other), median of --repeats loops; the same loop around the XLA expression of
the kernel (norm, product, bias, rotary, activation, residual as `specjax.models.layers` compute
them) is the baseline, and the same loop with the kernel replaced by one tiny fusion is the loop's
own cost (`floor_us`: subtract it from both to compare the kernels alone). A tiling that fails to compile is recorded with its error.

Writes --out (config, git revision, device, a row per kernel, rows and tiling with us per call and
the XLA baseline) after every kernel, and --table-out: the fastest tiling per kernel and shape for
this device kind, in the layout `fused_decode.tuned_tiling` reads (SPECJAX_FUSED_TILINGS, or merged
into specjax/kernels/fused_tilings.json). --budget-s stops the grid early (rows first, in order).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.bench.env import device_info, environment, git_revision  # noqa: E402
from specjax.kernels import fused_decode as fd  # noqa: E402
from specjax.models import fused_layer  # noqa: E402
from specjax.models.layers import rope, split_gate_up  # noqa: E402

# (d_model, heads, kv heads, head_dim, ffn)
SMOLLM2 = (576, 9, 3, 64, 1536)
TINY = (72, 4, 2, 32, 80)


def tilings(m: int, k: int, tiny: bool) -> list[fd.Tiling]:
  """The grid for m rows and contraction k, unrolled contractions first (every block's loads issued
  before the first product): 16-row tensor-core tiles, and for one row the multiply-and-sum product
  too; looped contractions of 128 / 256 per step (1 or 3 pipeline stages), and all of k in one step."""
  one_step = fd._pow2(k)
  if tiny:
    return [fd.Tiling(16, 16, one_step, 4, 1), fd.Tiling(1, 16, 32, 2, 1, dot=False),
            fd.Tiling(1, 16, 32, 2, 1, dot=False, unroll=True)]
  bm = max(16, fd._pow2(m))
  grid = []
  if m == 1:
    grid += [fd.Tiling(1, bn, bk, warps, 1, dot=False, unroll=True)
             for bn, bk, warps in itertools.product((8, 16, 32), (64, 128), (2, 4, 8))]
  grid += [fd.Tiling(bm, bn, bk, 4, 1, unroll=True) for bn, bk in itertools.product((16, 32, 64), (64, 128))]
  bks = sorted({b for b in (128, 256, one_step) if b <= one_step})
  for bn, bk, stages in itertools.product((16, 32, 64), bks, (1, 3)):
    if stages == 1 or bk < one_step:   # pipeline stages matter only to a contraction loop
      grid.append(fd.Tiling(bm, bn, bk, 4, stages))
  if m == 1:
    for bn, bk, warps, stages in itertools.product((8, 16, 32), (128, 256), (2, 4, 8), (1, 3)):
      grid.append(fd.Tiling(1, bn, bk, warps, stages, dot=False))
  return grid


def cases(shape, m: int, rng, dtype):
  """kernel name -> (n, k, fused call (x, tiling) -> y, XLA call x -> y, feedback y -> x, x0): n and k
  the output and contraction widths of its tiling key.

  x is the kernel's varying input; the feedback makes the next call depend on this one's output."""
  d, h, kvh, hd, f = shape
  n = (h + 2 * kvh) * hd
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  nw = (1 + 0.1 * normal(d)).astype(dtype)
  # weights [out, in], as `layers.Linear` stores them; XLA's products below take them as the model does
  wqkv, wo, wgu, wd = (normal(a, b).astype(dtype) / 8 for a, b in ((n, d), (d, h * hd), (2 * f, d), (d, f)))
  pos = jnp.asarray(rng.integers(0, 500, (1, m)), jnp.int32)
  cos, sin = fused_layer.rope_tables(pos, hd, 100000.0)
  hin, act = normal(m, h * hd), normal(m, f).astype(dtype)

  def normed(x):
    return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * nw.astype(jnp.float32)).astype(dtype)

  group = h // kvh
  is_v = (jnp.arange(n // hd) % (group + 2)) == group + 1                        # [heads] value heads of the fused layout

  def qkv_xla(x):   # in the fused column layout (`layers.qkv_layout`): q and k heads rotated, v heads not
    y = jnp.einsum("mi,oi->mo", normed(x), wqkv, preferred_element_type=jnp.float32).reshape(1, m, n // hd, hd)
    return jnp.where(is_v[None, None, :, None], y, rope(y, pos, 100000.0)).reshape(m, n)

  def gate_up_xla(x):
    g, u = split_gate_up(jnp.einsum("mi,oi->mo", normed(x), wgu, preferred_element_type=jnp.float32))
    return (jax.nn.silu(g) * u).astype(dtype)

  head = lambda y: y[:, :d].astype(jnp.float32)
  same = lambda y: y
  return {
      "norm_qkv_rope": (n, d, lambda x, tl: fd.norm_qkv_rope(x, nw, wqkv, cos, sin, eps=1e-5, offset=False, n_heads=h,
                                                             n_kv_heads=kvh, head_dim=hd, tiling=tl),
                        qkv_xla, head, normal(m, d)),
      "matmul_residual o_proj": (d, h * hd, lambda r, tl: fd.matmul_residual(hin, wo, r, tiling=tl),
                                 lambda r: r + jnp.einsum("mi,oi->mo", hin.astype(dtype), wo,
                                                          preferred_element_type=jnp.float32),
                                 same, normal(m, d)),
      "norm_gate_up": (2 * f, d, lambda x, tl: fd.norm_gate_up(x, nw, wgu, eps=1e-5, offset=False, tiling=tl),
                       gate_up_xla, head, normal(m, d)),
      "matmul_residual down_proj": (d, f, lambda r, tl: fd.matmul_residual(act, wd, r, tiling=tl),
                                    lambda r: r + jnp.einsum("mi,oi->mo", act, wd, preferred_element_type=jnp.float32),
                                    same, normal(m, d)),
  }


def us_per_call(step, feedback, x0, steps: int, repeats: int) -> list[float]:
  """us per call of `step` over `repeats` loops of `steps` dependent calls (after one compile + warm-up loop)."""
  loop = jax.jit(lambda x: jax.lax.fori_loop(0, steps, lambda _, x: feedback(step(x)), x))
  jax.block_until_ready(loop(x0))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(x0))
    times.append((time.perf_counter() - t0) / steps * 1e6)
  return times


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 4, 32])
  ap.add_argument("--kernels", nargs="+", default=None, help="kernel names (default: all four)")
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new tilings after this long")
  ap.add_argument("--tiny", action="store_true", help="a tiny shape, three tilings, 2 steps (CPU dry run, interpret mode)")
  ap.add_argument("--out", required=True)
  ap.add_argument("--table-out", default=None)
  args = ap.parse_args(argv)
  if args.tiny:
    args.rows, args.steps, args.repeats = [1, 4], 2, 1
  shape = TINY if args.tiny else SMOLLM2
  dtype = jnp.dtype(args.dtype)
  device = device_info()
  result = {"experiment": "fused_tiling_sweep", "config": vars(args), "shape": dict(zip(
      ("d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"), shape)), "git_revision": git_revision(),
      "device": device, "environment": environment(), "rows": [], "best": {}}
  table: dict = {}
  t_start = time.perf_counter()

  def save():
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    if args.table_out:
      Path(args.table_out).write_text(json.dumps({device["device_kind"]: table}, indent=2, sort_keys=True))

  rng = np.random.default_rng(0)
  for m in args.rows:
    for name, (n, k, fused, xla, feedback, x0) in cases(shape, m, rng, dtype).items():
      if args.kernels and name not in args.kernels and name.split()[0] not in args.kernels:
        continue
      kernel = name.split()[0]
      key = fd.tiling_key(kernel, m, n, k)
      xla_us = statistics.median(us_per_call(xla, feedback, x0, args.steps, args.repeats))
      y0 = xla(x0)
      want = np.asarray(y0, np.float32)
      # the loop's own cost: the same dependent chain with the kernel replaced by one broadcast of
      # an element of its input (no captured constant: a closed-over output array made the floor
      # loop slower than the kernels it was to be subtracted from)
      floor_us = statistics.median(us_per_call(
          lambda x, shape=y0.shape, dt=y0.dtype: jnp.broadcast_to(x[:1, :1].astype(dt), shape), feedback, x0,
          args.steps, args.repeats))
      best, default_us = None, None
      for tl in [None] + tilings(m, k, args.tiny):   # None: the kernel's own choice (table or rule)
        if time.perf_counter() - t_start > args.budget_s:
          break
        row = {"kernel": name, "key": key, "rows": m, "tiling": "default" if tl is None else tl.__dict__,
               "xla_us": xla_us, "floor_us": floor_us}
        try:
          got = np.asarray(fused(x0, tl), np.float32)
          row["max_abs_diff"] = float(np.max(np.abs(got - want)))
          row["us"] = statistics.median(us_per_call(functools.partial(fused, tl=tl), feedback, x0, args.steps,
                                                    args.repeats))
        except Exception as e:  # noqa: BLE001 - a tiling Triton cannot compile (registers, shared memory)
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        result["rows"].append(row)
        if tl is None:
          default_us = row.get("us")
        elif "us" in row and (best is None or row["us"] < best["us"]):
          best = row
      if best is not None:
        table[key] = best["tiling"]
        result["best"][f"{name} m{m}"] = {"key": key, "us": best["us"], "xla_us": xla_us,
                                          "speedup": xla_us / best["us"], "tiling": best["tiling"],
                                          "max_abs_diff": best["max_abs_diff"], "default_us": default_us,
                                          "floor_us": floor_us}
        print(f"{name:26s} m={m:3d}: loop floor {floor_us:6.2f} us  xla {xla_us:7.2f} us  default {default_us or float('nan'):7.2f} us  "
              f"best {best['us']:7.2f} us ({xla_us / best['us']:.2f}x xla) "
              f"{best['tiling']}  max|diff| {best['max_abs_diff']:.3g}", flush=True)
      save()
  result["elapsed_s"] = time.perf_counter() - t_start
  save()


if __name__ == "__main__":
  main()
