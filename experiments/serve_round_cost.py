"""What a serving round costs beside the offline engine's round (one request; plain decoding, or
one speculator with --speculator).

`specjax serve` at one client ran a plain round in 1.88 ms where the offline engine's decode step
takes 1.08 ms on the same GPU and capacity (experiments/README, "How fast is specjax serving under
load?"). This script splits that gap in one process:

- engine: `generate_plain` at batch 1 with --capacity, timed at two lengths (--new-tokens and half
  of it); ms per step = the difference of the times over the difference of the steps, so the
  prefill drops out;
- serve: a `SlotEngine` (`build_server`'s, plain decoding) for each --slots and --rounds-per-call,
  one request prefilled into slot 0, then `SlotEngine.step` called until it is done; ms per round =
  the time of those calls over the rounds they ran (the host work of a call included, no
  scheduler). With 1 slot nothing is gathered or written back; with more, the live slot is
  gathered into the batch-1 bucket per call.

With --speculator NAME (--n-max K, --head PATH; with --random-shape or --tiny an MTP head is random,
so its drafts are rarely accepted, which leaves the round's cost as it is): the engine's round is
`speculative_generate`'s at batch 1, ms per round = the difference of the times over the
difference of the rounds; the server's is `SlotEngine.step` at the drafter's full width (not
adaptive: every round drafts K), each request asking for n_max K. Rows also give tokens per round,
so the two rounds can be compared as work done, not only as time.

Every configuration runs once untimed (compilation) and --repeats times timed (the median kept).
--trace profiles one more request of every row (`jax.profiler`; on a GPU): the device's busy time,
kernels and the gaps between them per round, and kernels by kind and name (`profile_decode_trace`),
so the engine's and the server's rounds can be compared kernel by kernel (--trace-dir keeps the traces).
--prefill-rows N... adds, per --slots, the time of prefilling N requests at once: until
`SlotEngine.prefill` returns and until the state is ready (does a prefill call block the host?).
--greedy-argmax takes every sampled token (engine, prefill, plain rounds) as the logits' argmax alone,
without the `lax.cond` between the greedy and the sampled draw (every request here is greedy, so
the tokens do not change): whether that conditional, whose predicate XLA reads on the host, is
what holds the host in a call (run the same command with and without it).
The JSON (config, git revision, device, rows) goes to --out; a table is printed.

  python experiments/serve_round_cost.py --out $OUT/serve_round_cost.json                 # GPU, bf16
  python experiments/serve_round_cost.py --random-shape --out $OUT/serve_round_cost.json  # no weights needed
  python experiments/serve_round_cost.py --tiny --new-tokens 16 --out /tmp/src.json       # CPU dry run
  python experiments/serve_round_cost.py --speculator mtp --n-max 3 --head assets/smollm2/mtp/mtp_head.safetensors \
      --slots 1 64 --rounds-per-call 1 8 --out $OUT/serve_round_cost_mtp.json             # GPU, the trained head
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from decode_flags import greedy_argmax  # noqa: E402
from specjax.bench.env import device_info, git_revision  # noqa: E402
from specjax.drafters.base import DraftParams  # noqa: E402
from specjax.engine import speculative_generate  # noqa: E402
from specjax.engine.decode import generate_plain  # noqa: E402
from specjax.models.load import LoadedModel  # noqa: E402
from specjax.serve.cli import build_server  # noqa: E402


def load_target(args):
  if args.tiny:
    from specjax.models.config import ModelConfig
    from specjax.models.decoder import init_params
    cfg = ModelConfig(arch="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                      ffn_dim=128, rope_theta=10000.0, norm_eps=1e-6)
    return LoadedModel("tiny", cfg, init_params(cfg, seed=0)), [1 + i % 200 for i in range(40)]
  if args.random_shape:
    # SmolLM2-135M's shapes with random weights: the same kernels and launches as the real model, so
    # round costs need no weights on the machine (greedy output is meaningless; no stop token ends it)
    import jax.numpy as jnp
    from sharding_bench import SMOLLM2_SHAPES
    from specjax.models.decoder import init_params
    cfg = SMOLLM2_SHAPES
    return LoadedModel("smollm2-shaped-random", cfg, init_params(cfg, seed=0, dtype=jnp.dtype(args.dtype))), \
        [1 + i % 20000 for i in range(40)]
  from specjax import api
  target = api.load(args.model, dtype=args.dtype)
  prompt = target.tokenizer.encode_chat([{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}])
  return target, prompt


def speculator_args(target, args) -> dict:
  """`build_server` / `make_speculator` keywords of --speculator (empty: plain decoding)."""
  if not args.speculator:
    return {}
  head = args.head
  if head is None and args.speculator == "mtp" and (args.tiny or args.random_shape):
    from specjax.drafters.mtp import init_heads
    head = init_heads(target.cfg, args.n_max, seed=1)
  return {"speculator": args.speculator, "head": head, "n_max": args.n_max}


def engine_ms_per_step(target, prompt, args) -> tuple[float, float, dict | None]:
  """(ms per round, tokens per round): median over repeats of (t(N) - t(N/2)) / (rounds(N) -
  rounds(N/2)) for the engine at batch 1 (a plain round is one step), and of (N - 1) / rounds(N): the
  tokens a round emits over the whole request, the first token being the prefill's; with --trace
  also the profile of one more request (`profile_rounds`)."""
  lengths = (args.new_tokens // 2, args.new_tokens)
  spec = speculator_args(target, args)
  if spec:
    from specjax.drafters.registry import make_speculator
    drafter = make_speculator(spec["speculator"], target, head=spec["head"], draft_params=DraftParams(n_max=args.n_max))

    def run(n):
      out = speculative_generate(target.params, target.cfg, [prompt], drafter, max_new_tokens=n, capacity=args.capacity,
                                 draft_params=DraftParams(n_max=args.n_max))
      return out.seconds, out.stats.rounds, len(out.tokens[0])
  else:
    def run(n):
      out = generate_plain(target.params, target.cfg, [prompt], max_new_tokens=n, capacity=args.capacity)
      return out.seconds, n - 1, n                              # the first token is the prefill's
  for n in lengths:
    run(n)                                                      # compilation
  diffs, rates = [], []
  for _ in range(args.repeats):
    (t0, r0, n0), (t1, r1, n1) = run(lengths[0]), run(lengths[1])
    diffs.append((t1 - t0) / max(r1 - r0, 1))
    rates.append((n1 - 1) / max(r1, 1))      # the whole request, as the server rows count it (prefill's token out)
  profile = None
  if args.trace:       # one more request of --new-tokens: its rounds include the prefill's share
    profile = profile_rounds(lambda: Timed(*run(lengths[1])[:2]), args, "engine")
  return 1e3 * statistics.median(diffs), statistics.median(rates), profile


def slot_engine(target, args, slots: int, rounds_per_call: int):
  """`build_server`'s SlotEngine for `slots` (batch buckets up to it) and the speculator's arguments."""
  spec = speculator_args(target, args)
  engine = build_server(target, slots=slots, capacity=args.capacity, max_queue=4,
                        buckets=[n for n in (1, 8, 32, 64) if n <= slots], rounds_per_call=rounds_per_call,
                        **spec).scheduler.engine
  return engine, spec


def serve_ms_per_round(target, prompt, args, slots: int, rounds_per_call: int) -> tuple[float, int, float, dict | None]:
  """Median ms per round of `SlotEngine.step` for one request of --new-tokens, its rounds and its
  tokens per round; with --trace also the profile of one more request (`profile_rounds`)."""
  engine, spec = slot_engine(target, args, slots, rounds_per_call)

  def one_request() -> Timed:
    j = engine.begin_join(prompt, slot=0, draft=DraftParams(n_max=args.n_max if spec else 0), max_new=args.new_tokens)
    while not engine.prefill([j]):                               # the prompt's pieces into slot 0
      pass
    engine.first_tokens()
    jax.block_until_ready(engine.state)
    t0, rounds = time.perf_counter(), 0
    while engine.live.any():
      rounds += engine.step(rounds_per_call).rounds
    seconds = time.perf_counter() - t0
    engine.finish([0])
    return Timed(seconds, rounds)

  times, rounds = [], 0
  for _ in range(args.repeats + 1):
    r = one_request()
    times.append(r.seconds / max(r.rounds, 1))
    rounds = r.rounds
  profile = profile_rounds(one_request, args, f"serve_s{slots}_r{rounds_per_call}") if args.trace else None
  return 1e3 * statistics.median(times[1:]), rounds, (args.new_tokens - 1) / max(rounds, 1), profile   # the first token is the prefill's


def serve_prefill_ms(target, prompt, args, slots: int, n_rows: int) -> dict:
  """Median ms of prefilling `n_rows` requests of the prompt at once (slots 0..n_rows-1): until
  `SlotEngine.prefill` returns on the host ("dispatch") and until the slot state is ready
  ("ready"). Dispatch near ready means the call waits for the device (a host read inside the
  program, say), not that it only queues the work."""
  engine, spec = slot_engine(target, args, slots, 1)
  rows = list(range(n_rows))

  def once() -> tuple[float, float, int]:
    joins = [engine.begin_join(prompt, slot=i, draft=DraftParams(n_max=args.n_max if spec else 0),
                               max_new=args.new_tokens) for i in rows]
    jax.block_until_ready((engine.state, engine.dstate))
    t0, calls = time.perf_counter(), 0
    while not engine.prefill(joins):                              # same prompt: every row ends at once
      calls += 1
    t1 = time.perf_counter()
    jax.block_until_ready((engine.state, engine.dstate))
    t2 = time.perf_counter()
    engine.first_tokens()
    engine.finish(rows)
    return t1 - t0, t2 - t0, calls + 1

  runs = [once() for _ in range(args.repeats + 1)][1:]
  return {"what": "serve prefill", "slots": slots, "rows": n_rows, "calls": runs[0][2],
          "dispatch_ms": round(1e3 * statistics.median(r[0] for r in runs), 4),
          "ready_ms": round(1e3 * statistics.median(r[1] for r in runs), 4)}


@dataclasses.dataclass
class Timed:
  seconds: float
  rounds: int


def profile_rounds(run, args, tag: str) -> dict:
  """`run()` (a compiled request -> Timed) under the profiler: its device time per round (busy vs
  wall, kernels and gaps per round, kernels by kind and the top ones; `profile_decode_trace.summarize`
  with a round as its step). On a CPU backend the trace has no device events: only the wall time."""
  from profile_decode_trace import summarize, traced_generation
  result = {}

  def traced():
    result["run"] = run()
    return result["run"]
  with tempfile.TemporaryDirectory() as tmp:
    seconds, events, trace = traced_generation(traced, Path(tmp))
    if args.trace_dir:
      Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
      shutil.copy(trace, Path(args.trace_dir) / f"{tag}.json.gz")
  rounds = result["run"].rounds
  if not events:
    return {"rounds": rounds, "wall_ms_per_round": round(1e3 * seconds / max(rounds, 1), 4), "device_events": 0}
  summary = summarize(events, max(rounds, 1), seconds, top=args.trace_top)
  return {"rounds": rounds, **{k.replace("_step", "_round"): v for k, v in summary.items() if k != "steps"}}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--capacity", type=int, default=1024)
  ap.add_argument("--new-tokens", type=int, default=256)
  ap.add_argument("--slots", type=int, nargs="+", default=[1, 64])
  ap.add_argument("--rounds-per-call", type=int, nargs="+", default=[1, 8])
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--tiny", action="store_true", help="a tiny float32 target (CPU dry run)")
  ap.add_argument("--random-shape", action="store_true",
                  help="SmolLM2-135M's shapes with random weights in --dtype (no weights needed)")
  ap.add_argument("--speculator", default=None, help="a registry name (default: plain decoding)")
  ap.add_argument("--n-max", type=int, default=3, help="the speculator's draft length (every round drafts it)")
  ap.add_argument("--head", default=None, help="the speculator's head file (random MTP head with --tiny / --random-shape)")
  ap.add_argument("--trace", action="store_true",
                  help="profile one more request of each row: device busy time, kernels and gaps per round")
  ap.add_argument("--trace-top", type=int, default=12, help="kernels by name kept per profile")
  ap.add_argument("--trace-dir", default=None, help="keep each profile's perfetto trace here")
  ap.add_argument("--prefill-rows", type=int, nargs="*", default=[],
                  help="also time prefilling this many requests at once (dispatch vs ready), per --slots")
  ap.add_argument("--greedy-argmax", action="store_true",
                  help="sampled tokens as a bare argmax, no greedy / sampled conditional (all requests are greedy)")
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  if args.trace:
    from profile_decode_trace import keep_command_buffers_when_traced
    keep_command_buffers_when_traced()
  if args.greedy_argmax:
    greedy_argmax()
  target, prompt = load_target(args)
  ms, rate, profile = engine_ms_per_step(target, prompt, args)
  rows = [{"what": "engine round" if args.speculator else "engine decode step", "slots": None, "rounds_per_call": None,
           "ms": round(ms, 4), "tokens_per_round": round(rate, 3), **({"profile": profile} if profile else {})}]
  print(json.dumps(rows[-1]), flush=True)
  for slots in args.slots:
    for rpc in args.rounds_per_call:
      ms, rounds, rate, profile = serve_ms_per_round(target, prompt, args, slots, rpc)
      rows.append({"what": "serve round", "slots": slots, "rounds_per_call": rpc, "ms": round(ms, 4),
                   "rounds": rounds, "tokens_per_round": round(rate, 3), "ratio_to_engine": round(ms / rows[0]["ms"], 3) if rows[0]["ms"] > 0 else None,
                   **({"profile": profile} if profile else {})})
      print(json.dumps(rows[-1]), flush=True)
  for slots in args.slots:
    for n_rows in args.prefill_rows:
      if n_rows <= slots:
        rows.append(serve_prefill_ms(target, prompt, args, slots, n_rows))
        print(json.dumps(rows[-1]), flush=True)
  out = {"experiment": "serve_round_cost", "config": {k: v for k, v in vars(args).items() if k != "out"},
         "git_revision": git_revision(), "device": device_info(), "prompt_tokens": len(prompt), "rows": rows}
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
  print(f"{args.speculator or 'plain'}: {'what':20s} {'slots':>5s} {'rounds/call':>11s} {'ms':>8s} {'tokens/round':>12s}")
  for r in rows:
    if r["what"] == "serve prefill":
      print(f"{r['what']:20s} {r['slots']:>5} {r['rows']:>4} rows: dispatch {r['dispatch_ms']:8.3f} ms, "
            f"ready {r['ready_ms']:8.3f} ms ({r['calls']} calls)")
      continue
    print(f"{r['what']:20s} {r['slots'] or '-':>5} {r['rounds_per_call'] or '-':>11} {r['ms']:8.3f} "
          f"{r['tokens_per_round']:12.2f}")
  for r in rows:
    p = r.get("profile")
    if p and p.get("busy_ms_per_round") is not None:
      print(f"[trace] {r['what']:20s} slots {r['slots'] or '-'} rounds/call {r['rounds_per_call'] or '-'}: wall "
            f"{p['wall_ms_per_round']:.3f} ms, busy {p['busy_ms_per_round']:.3f} ms, {p['kernels_per_round']} kernels, "
            f"gaps {p['gap_us']['sum_ms_per_step']:.3f} ms a round")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
