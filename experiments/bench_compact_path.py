"""The tree round's path move alone: XLA's gather + scatter per array vs the one-launch Pallas kernel.

SmolLM2's cache (30 layers, K and V: 60 arrays [B, capacity, 3, 64] bf16, random values), a
depth-8 accepted path per sequence (src 0, then rising node indices), at each --batch. Each
implementation is jitted with the caches donated (as inside the engine's loop, where the move
updates the cache in place), checked bitwise against the other, then timed: --repeats calls of a
device loop of --steps moves (`lax.fori_loop`, so the launches are back to back as in a round),
median ms per move. Also the kernels each compiles into (`decode_flags.kernel_count` on the
compiled HLO).

  python experiments/bench_compact_path.py --out $OUT/compact_path.json            # GPU
  python experiments/bench_compact_path.py --batch 1 --capacity 64 --steps 2 --repeats 1 --out /tmp/c.json   # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode_flags import kernel_count  # noqa: E402
from specjax.bench.env import device_info, git_revision  # noqa: E402
from specjax.kernels import compact_path as cp  # noqa: E402


def case(batch: int, capacity: int, n_arrays: int, depth: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  arrays = tuple(jnp.asarray(rng.standard_normal((batch, capacity, 3, 64), np.float32), jnp.bfloat16)
                 for _ in range(n_arrays))
  base = jnp.asarray(rng.integers(capacity // 4, capacity // 2, batch), jnp.int32)
  src = np.concatenate([np.zeros((batch, 1), np.int64), np.cumsum(rng.integers(1, 4, (batch, depth)), axis=1)], 1)
  return arrays, base, jnp.asarray(src, jnp.int32)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
  ap.add_argument("--capacity", type=int, default=1024)
  ap.add_argument("--arrays", type=int, default=60)
  ap.add_argument("--depth", type=int, default=8)
  ap.add_argument("--steps", type=int, default=200, help="moves per timed device loop")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  interpret = jax.default_backend() != "gpu"
  impls = {"xla": cp.compact_reference,
           "pallas": lambda a, b, s: cp.pallas_compact(a, b, s, interpret=interpret)}
  rows = []
  for batch in args.batch:
    arrays, base, src = case(batch, args.capacity, args.arrays, args.depth)
    outs, row = {}, {"batch": batch}
    for name, fn in impls.items():
      loop = jax.jit(lambda a, b, s, fn=fn: jax.lax.fori_loop(0, args.steps, lambda i, x: fn(x, b, s), a),
                     donate_argnums=0)
      once = jax.jit(fn)
      row[f"{name}_kernels"] = kernel_count(once.lower(arrays, base, src).compile().as_text())
      outs[name] = jax.device_get(once(arrays, base, src))
      loop(tuple(jnp.copy(x) for x in arrays), base, src)[0].block_until_ready()     # compile
      ms = []
      for _ in range(args.repeats):
        fresh = tuple(jnp.copy(x) for x in arrays)
        jax.block_until_ready(fresh)
        t0 = time.perf_counter()
        loop(fresh, base, src)[0].block_until_ready()
        ms.append((time.perf_counter() - t0) * 1e3 / args.steps)
      row[f"{name}_ms"] = float(np.median(ms))
    row["equal"] = all(np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
                       for x, y in zip(outs["xla"], outs["pallas"]))
    row["speedup"] = row["xla_ms"] / row["pallas_ms"]
    rows.append(row)
    print(f"[compact_path] batch {batch:3d}: xla {row['xla_ms'] * 1e3:8.1f} us ({row['xla_kernels']} kernels)  "
          f"pallas {row['pallas_ms'] * 1e3:8.1f} us ({row['pallas_kernels']} kernels)  equal {row['equal']}", flush=True)
  out = {"experiment": "compact_path", "config": vars(args), "git_revision": git_revision(), "device": device_info(),
         "interpret": interpret, "rows": rows}
  Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
