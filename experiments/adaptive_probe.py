"""Where an adaptive speculator's time goes beside plain decoding, batch by batch: for each method of a
bench config, on the config's first batches of prompts, the whole call (as the benchmark times it)
split into the prefill (waited for) and the rest, for the method as configured, pinned to width 0
(adaptive with the width-0 rung only: every fixed cost of the adaptive path, no drafting), held at
width 0 in the program of every width (`width0_all`: given costs that make width 0 win and no
exploring rounds, so the rounds run where the configured run's width-0 rounds run) and, for device
drafters, the fixed (non-adaptive) loop; plain decoding's split beside them. Minimum and median
over `--repeats` timed calls after one warm-up per variant (which compiles and times round costs).

  python experiments/adaptive_probe.py --config configs/bench_adaptive_heads_smollm2_b8.yaml --batches 1 --out /tmp/probe.json
  OUT=... bash experiments/gpu/bootstrap.sh python3 experiments/adaptive_probe.py \\
      --config configs/bench_adaptive_heads_smollm2_b8.yaml --out $OUT/adaptive_probe_heads_b8.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_decode_trace import keep_command_buffers_when_traced, traced_summary  # noqa: E402

from specjax.bench.config import DEFAULT_CAPACITY, load_config  # noqa: E402
from specjax.bench.env import device_info, git_revision  # noqa: E402
from specjax.bench.harness import load_questions, load_target  # noqa: E402
from specjax.bench.runner import Runner, _encode, _messages  # noqa: E402
from specjax.bench.timing import heap_frozen  # noqa: E402
from specjax.engine import speculative_generate  # noqa: E402
from specjax.engine.decode import generate_plain  # noqa: E402
from specjax.engine.sampling import SamplingParams  # noqa: E402


def summary(calls: list[tuple[float, float | None]]) -> dict:
  """ms of the whole call and of its prefill: min and median over the timed calls."""
  total = [c[0] * 1e3 for c in calls]
  prefill = [c[1] * 1e3 for c in calls if c[1] is not None]
  out = {"total_ms_min": min(total), "total_ms_median": statistics.median(total)}
  if prefill:
    out |= {"prefill_ms_min": min(prefill), "prefill_ms_median": statistics.median(prefill),
            "after_prefill_ms_min": min(t - p for t, p in zip(total, prefill))}
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", required=True, help="a `specjax bench` config (target, prompts, batch size, methods)")
  ap.add_argument("--batches", type=int, default=1, help="the config's first N batches")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--methods", nargs="*", help="only these methods of the config (names)")
  ap.add_argument("--variants", nargs="+", default=["configured", "width0"],
                  choices=["configured", "width0", "width0_all", "fixed"],
                  help="each compiles its own program (~1 min per method on a GPU)")
  ap.add_argument("--trace", action="store_true",
                  help="one more call of plain decoding and of each variant under the profiler (a GPU): kernels "
                       "per round, device-busy time, the gaps where the device waits, the top kernels")
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  if args.trace:
    keep_command_buffers_when_traced()
  cfg = load_config(args.config)
  questions = load_questions(cfg)
  target = load_target(cfg)
  methods = [m for m in cfg.methods if not args.methods or m.name in args.methods]
  s = cfg.sampling
  rows = []

  def save(rows):
    result = {"what": "ms per batch call: whole, prefill, after prefill; as configured, pinned at width 0, fixed loop",
              "config": args.config, "git_revision": git_revision(), "device": device_info(), "args": vars(args),
              "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
  for start in range(0, min(len(questions), args.batches * cfg.batch_size), cfg.batch_size):
    batch = questions[start: start + cfg.batch_size]
    prompts = [_encode(cfg, target.tokenizer, _messages(q, [], 0)) for q in batch]
    b = len(prompts)
    stop_ids = tuple(target.tokenizer.eos_ids) if target.tokenizer is not None else ()

    def kw(n):
      return dict(max_new_tokens=n, stop_ids=stop_ids, capacity=cfg.capacity or DEFAULT_CAPACITY,
                  sampling=SamplingParams.make(b, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                               seed=cfg.seed), split_prefill=True)

    def plain(n):
      with heap_frozen():   # as the bench times a call
        r = generate_plain(target.params, target.cfg, prompts, **kw(n))
      return r.seconds, r.prefill_seconds

    plain(min(cfg.max_new_tokens, 16))
    base = summary([plain(cfg.max_new_tokens) for _ in range(args.repeats)])
    if args.trace:
      base["trace"] = traced_summary(lambda: plain(cfg.max_new_tokens), cfg.max_new_tokens)
    row = {"batch": start // cfg.batch_size, "questions": [q.question_id for q in batch], "plain": base}
    rows.append(row)
    save(rows)
    print(json.dumps({"batch": row["batch"], "plain": base}), flush=True)
    for m in methods:
      runner = Runner(cfg, target, m, {})
      variants = {"configured": runner.adaptive}
      if runner.adaptive is not None:
        variants["width0"] = dataclasses.replace(runner.adaptive, widths=(0,))
        n = len(runner.adaptive.widths_for(runner.drafter.max_draft, tree=runner.drafter.proposes_tree))
        variants["width0_all"] = dataclasses.replace(runner.adaptive, costs=tuple(1.0 + 1e3 * i for i in range(n)),
                                                     explore_rounds=0)
      if runner.drafter.on_device:
        variants["fixed"] = None
      variants = {k: v for k, v in variants.items() if k in args.variants}
      out = {}
      for name, ad in variants.items():
        records = []

        def call(n, warm=False, ad=ad):
          with heap_frozen():
            r = speculative_generate(target.params, target.cfg, prompts, runner.drafter,
                                     draft_params=runner.draft_params, warm_widths=warm, adaptive=ad, **kw(n))
          if not warm:
            records.append(r.stats)
          return r.seconds, r.prefill_seconds

        snap = runner._snapshot()
        calls = []
        for i, c in enumerate([min(cfg.max_new_tokens, 16)] + [cfg.max_new_tokens] * args.repeats):
          runner._restore(snap)      # drafters with cross-request memory start each call alike
          got = call(c, warm=i == 0)
          if i:
            calls.append(got)
        st = records[-1]
        out[name] = {**summary(calls), "tau": st.tau, "rounds": max(st.per_seq_rounds),
                     "segments": (st.adaptive or {}).get("segments"), "costs_ms": (st.adaptive or {}).get("costs_ms")}
        out[name]["x_plain"] = base["total_ms_min"] / out[name]["total_ms_min"]
        if args.trace:
          runner._restore(snap)
          out[name]["trace"] = traced_summary(lambda: call(cfg.max_new_tokens), out[name]["rounds"])
        row[m.name] = out
        save(rows)    # after each variant: a run cut by a time limit keeps what it finished
      print(json.dumps({"batch": row["batch"], m.name: {k: {kk: (round(vv, 3) if isinstance(vv, float) else vv)
                                                           for kk, vv in v.items() if kk != "costs_ms"}
                                                       for k, v in out.items()}}), flush=True)


if __name__ == "__main__":
  main()
