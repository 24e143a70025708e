"""What a serving device call costs besides its rounds, split into its parts (plain decoding).

On an H100 a call of `slot_programs.run_rounds` costs ~2.4 ms besides its rounds (SmolLM2's shapes,
64 slots: 3.65 ms per round at 1 round per call, 1.23 at 32; experiments/README, "How fast is
specjax serving under load?"). On the GPU the jitted call returns only once its program has run (the
`while_loop` reads its condition on the host every round), so the time of the call itself is the
program's time plus the host's dispatch. This script times, for one request in slot 0, the call and
then the transfer of its outputs, at 1 and 8 rounds per call, in three layouts:

  1 slot              nothing gathered or written back (the slot batch is the request)
  64 slots, bucket 1  the live slot's rows gathered into a batch of 1 and written back
  64 slots, full      every slot runs (no gather), the request's the only live one

and for each with the call's small inputs (the bucket's slot indices, the number of rounds) given
as host arrays (as `SlotEngine.step` does: copied to the device at every call) or kept on the
device, and its four outputs fetched as they are (as `SlotEngine.step` does) or packed on the
device into one array first. The fixed cost of a call is then read off as ms(1 round) - (ms(8
rounds) - ms(1 round)) / 7. The JSON (config, git revision, device, rows) goes to --out.

  python experiments/serve_call_cost.py --out $OUT/serve_call_cost.json                 # GPU, bf16, random weights
  python experiments/serve_call_cost.py --tiny --calls 4 --out /tmp/scc.json            # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.serve_round_cost import load_target  # noqa: E402
from specjax.bench.env import device_info, git_revision  # noqa: E402
from specjax.drafters.base import DraftParams  # noqa: E402
from specjax.serve import slot_programs as programs  # noqa: E402
from specjax.serve.cli import build_server  # noqa: E402

LAYOUTS = (("1 slot", 1, True), ("64 slots, bucket 1", 64, False), ("64 slots, full", 64, True))


@jax.jit
def pack(new, counts, done, ran):
  """The call's four outputs as one int32 vector (one device-to-host transfer)."""
  return jnp.concatenate([new.ravel(), counts.ravel(), done.astype(jnp.int32), ran[None].astype(jnp.int32)])


def time_calls(engine, rows, rounds: int, device_inputs: bool, calls: int) -> dict:
  """Median ms of the jitted call (until its outputs are ready) and of fetching its outputs (4 arrays
  on odd calls, packed on even ones) over `calls` calls after 2 untimed ones."""
  if device_inputs:
    rows = None if rows is None else jax.device_put(rows)
  n_rounds = jax.device_put(np.int32(rounds)) if device_inputs else np.int32(rounds)
  spec, inputs = engine._device_round(None, engine.dp["n_max"])
  call, get4, get1 = [], [], []
  for i in range(calls + 2):
    args, kw = engine._round_args(spec, inputs, None, rows, rounds)
    args = args[:10] + (n_rounds,) + args[11:]
    jax.block_until_ready(engine.state)
    t0 = time.perf_counter()
    out = programs.run_rounds(*args, **kw)
    jax.block_until_ready(out)
    t1 = time.perf_counter()
    engine.state, engine.dstate = out[0], out[1]
    if i % 2:
      jax.device_get(out[2:6])
    else:
      jax.device_get(pack(*out[2:6]))
    t2 = time.perf_counter()
    if i >= 2:
      call.append(t1 - t0)
      (get4 if i % 2 else get1).append(t2 - t1)
  ms = lambda v: round(1e3 * statistics.median(v), 4) if v else None
  return {"call_ms": ms(call), "fetch_4_arrays_ms": ms(get4), "fetch_packed_ms": ms(get1)}


def seat(engine, prompt, capacity: int) -> None:
  """One request in slot 0 (the one there before, if any, finished), prefilled, allowed to fill its slot."""
  if engine.live.any():
    engine.finish([0])
  j = engine.begin_join(prompt, slot=0, draft=DraftParams(n_max=0), max_new=capacity - len(prompt) - 1)
  while not engine.prefill([j]):
    pass
  engine.first_tokens()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--capacity", type=int, default=1024)
  ap.add_argument("--calls", type=int, default=30, help="timed calls per row (default 30)")
  ap.add_argument("--tiny", action="store_true", help="a tiny float32 target (CPU dry run)")
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  args.random_shape = not args.tiny              # SmolLM2's shapes, random weights (load_target)
  target, prompt = load_target(args)
  rows = []
  for layout, slots, full in LAYOUTS:
    engine = build_server(target, None, slots=slots, capacity=args.capacity, max_queue=4, buckets=[1],
                          rounds_per_call=8).scheduler.engine
    for device_inputs in (False, True):
      seat(engine, prompt, args.capacity)            # a fresh request: room for every round timed
      bucket = None if full else engine.bucket_rows()
      by_rounds = {r: time_calls(engine, bucket, r, device_inputs, args.calls) for r in (1, 8)}
      one, eight = by_rounds[1]["call_ms"], by_rounds[8]["call_ms"]
      row = {"layout": layout, "slots": slots, "inputs": "device" if device_inputs else "host",
             "rounds": by_rounds, "round_ms": round((eight - one) / 7, 4),
             "fixed_ms": round(one - (eight - one) / 7, 4)}
      rows.append(row)
      print(json.dumps(row), flush=True)
  out = {"experiment": "serve_call_cost", "config": {k: v for k, v in vars(args).items() if k != "out"},
         "git_revision": git_revision(), "device": device_info(), "prompt_tokens": len(prompt), "rows": rows}
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
  print(f"{'layout':20s} {'inputs':>6s} {'call 1':>8s} {'call 8':>8s} {'round':>7s} {'fixed':>7s} {'fetch 4':>8s} {'packed':>7s}")
  for r in rows:
    one, eight = r["rounds"][1], r["rounds"][8]
    print(f"{r['layout']:20s} {r['inputs']:>6s} {one['call_ms']:8.3f} {eight['call_ms']:8.3f} {r['round_ms']:7.3f} "
          f"{r['fixed_ms']:7.3f} {one['fetch_4_arrays_ms']:8.3f} {one['fetch_packed_ms']:7.3f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
