"""Does writing a bucket's rows back into the donated slot state copy the whole state?

A serving call gathers the live slots' rows of the slot state (KV cache [slots, capacity, kv
heads, head dim] per layer), runs its rounds on them and scatters them back
(`slot_programs.run_rounds`). The state is donated, so the write-back can update it in place: the
GPU compiler does, the CPU compiler copies the whole leaf of a gather + loop + scatter (one copy per
KV leaf, temp = the leaf's size; experiments/README, "How fast is specjax serving under load?"). This
script compiles the patterns on the current backend and prints, for each, the copies of a
slot-sized array in the compiled program and its temp memory, beside the real serving program of
SmolLM2 (64 slots, capacity 1024, bucket 1) when --model is given:

  gather+scatter   jnp.take rows, 8 loop steps, .at[rows].set (what run_rounds does)
  scatter only     .at[rows].set of a given sub-batch
  dynamic slice    one row by lax.dynamic_slice / dynamic_update_slice

  python experiments/slot_write_back_copies.py --out $OUT/slot_write_back_copies.json [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specjax.bench.env import device_info, git_revision  # noqa: E402

SLOTS, CAP, KV, HD = 64, 1024, 3, 64


def copies(compiled, shape=(SLOTS, CAP)) -> dict:
  """Copies of arrays whose leading dims are `shape` in a compiled program, and its temp bytes."""
  key = ",".join(map(str, shape)) + ","
  text = compiled.as_text()
  n = sum(1 for line in text.splitlines() if " copy(" in line and key in line.replace(" ", ""))
  return {"copies": n, "temp_mb": round(compiled.memory_analysis().temp_size_in_bytes / 1e6, 2)}


def patterns() -> dict:
  full = jnp.zeros((SLOTS, CAP, KV, HD), jnp.bfloat16)          # one KV leaf of 64 slots
  rows = np.arange(1, dtype=np.int32)
  sub = jnp.ones((1, CAP, KV, HD), jnp.bfloat16)

  @functools.partial(jax.jit, donate_argnums=0)
  def gather_scatter(full, rows):
    s = jnp.take(full, rows, axis=0, mode="clip")
    s = jax.lax.fori_loop(0, 8, lambda i, x: x + 1, s)
    return full.at[rows].set(s, mode="drop")

  @functools.partial(jax.jit, donate_argnums=0)
  def scatter_only(full, sub, rows):
    return full.at[rows].set(sub, mode="drop")

  @functools.partial(jax.jit, donate_argnums=0)
  def dynamic_slice(full, rows):
    s = jax.lax.dynamic_slice_in_dim(full, rows[0], 1, 0)
    s = jax.lax.fori_loop(0, 8, lambda i, x: x + 1, s)
    return jax.lax.dynamic_update_slice_in_dim(full, s, rows[0], 0)

  return {"gather+scatter": copies(gather_scatter.lower(full, rows).compile()),
          "scatter only": copies(scatter_only.lower(full, sub, rows).compile()),
          "dynamic slice": copies(dynamic_slice.lower(full, rows).compile())}


def serving_program(model: str) -> dict:
  from specjax import api
  from specjax.serve.cli import build_server
  target = api.load(model, dtype="bfloat16")
  engine = build_server(target, None, slots=SLOTS, capacity=CAP, max_queue=4, buckets=[1, 8, 32, 64],
                        rounds_per_call=8).scheduler.engine
  return {f"serve plain round, bucket {n}": copies(engine._lower_round(None, rows).compile())
          for n, rows in ((1, np.arange(1, dtype=np.int32)), (SLOTS, None))}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default=None, help="also compile the real serving program of this model")
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  rows = patterns()
  if args.model:
    rows.update(serving_program(args.model))
  for name, r in rows.items():
    print(f"{name:32s} copies {r['copies']:3d}  temp {r['temp_mb']:9.2f} MB")
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps({"experiment": "slot_write_back_copies", "git_revision": git_revision(),
                                        "device": device_info(), "model": args.model, "rows": rows}, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
