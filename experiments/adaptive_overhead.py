"""What adaptive drafting costs beside plain decoding when it drafts nothing: ms per token of the plain
decode loop against the adaptive program pinned at width 0 (one segment) and choosing freely among
widths priced so that width 0 always wins, at several segment lengths (a per-segment cost shows as
ms per round falling with the segment length). Times are differences of a long and a short
generation (the per-call costs and the prefill drop out), median of `--repeats`; beside each, the
per-call cost (`*_call_ms`: the short run less its tokens at that rate), which a program's fixed
work per call (a command buffer updated for the call's buffers, a first entry into each loop) adds
to every request whatever its length. Beside the program of every width, the program of width 0
alone (`width0_alone_ms`). `--trace`: each of the three programs' `--long` run once more under the
profiler, kernels per token, device-busy time, gaps and the top kernels (`profile_decode_trace`), so
a program whose width-0 step costs more shows where: more kernels, copies, or the device waiting.

  python experiments/adaptive_overhead.py --tiny --out /tmp/adaptive_overhead.json                  # CPU
  OUT=... bash experiments/gpu/bootstrap.sh python3 experiments/adaptive_overhead.py --out $OUT/adaptive_overhead.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_decode_trace import keep_command_buffers_when_traced, traced_summary  # noqa: E402
from sharding_bench import RANDOM_SHAPES, random_target  # noqa: E402
from specjax.bench.env import device_info, git_revision  # noqa: E402
from specjax.drafters import speculator_spec  # noqa: E402
from specjax.drafters.base import DraftParams  # noqa: E402
from specjax.engine import adaptive as adapt  # noqa: E402
from specjax.engine.adaptive_loop import adaptive_run  # noqa: E402
from specjax.engine.decode import _decode_loop  # noqa: E402
from specjax.engine.generation import pad_prompts  # noqa: E402
from specjax.engine.loops import prefill_request  # noqa: E402
from specjax.engine.round import RoundInputs, RoundSpec  # noqa: E402
from specjax.engine.sampling import SamplingParams  # noqa: E402
from specjax.models.config import ModelConfig  # noqa: E402

TINY = ModelConfig(arch="llama", vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                   ffn_dim=128, norm_eps=1e-6)


def per_round_ms(run, short: int, long: int, repeats: int) -> tuple[float, float]:
  """(ms per token, ms per call): medians over repeats of (t(long) - t(short)) / (long - short) and
  of t(short) - short x that, after one untimed pass of each."""
  run(short), run(long)
  per_token, per_call = [], []
  for _ in range(repeats):
    t0 = time.perf_counter()
    run(short)
    t1 = time.perf_counter()
    run(long)
    t2 = time.perf_counter()
    rate = ((t2 - t1) - (t1 - t0)) / (long - short) * 1e3
    per_token.append(rate)
    per_call.append((t1 - t0) * 1e3 - short * rate)
  return float(np.median(per_token)), float(np.median(per_call))


def trace_run(run, tokens: int) -> dict:
  """`run(tokens)` once under the profiler, per token (`profile_decode_trace.traced_summary`), printed."""
  out = traced_summary(lambda: run(tokens), tokens)
  if "error" not in out:
    print(f"[trace] {out['wall_ms_per_step']:.3f} ms/token wall, busy {out['busy_ms_per_step']:.3f}, "
          f"{out['kernels_per_step']} kernels/token, gaps {out['gap_us']['sum_ms_per_step']:.3f} ms/token", flush=True)
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--tiny", action="store_true", help="a tiny float32 model (CPU)")
  ap.add_argument("--batch", type=int, nargs="+", default=[8])
  ap.add_argument("--speculators", nargs="+", default=["ngram_simple"])
  ap.add_argument("--segments", type=int, nargs="+", default=[16, 64])
  ap.add_argument("--short", type=int, default=32)
  ap.add_argument("--long", type=int, default=160)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--capacity", type=int, nargs="+", default=[512],
                  help="KV cache slots (a cost that grows with them shows here; the bench runs 2048)")
  ap.add_argument("--trace", action="store_true", help="trace each program's long run (a GPU)")
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  if args.trace:
    keep_command_buffers_when_traced()
  if args.tiny:
    target = random_target(TINY, "tiny (random)", dtype=jnp.float32)
  else:
    target = random_target(RANDOM_SHAPES["smollm2"], "smollm2 shapes (random)")
  cfg, params = target.cfg, target.params
  rows = []

  def save(rows):
    result = {"what": "ms per token and per call: plain decode loop vs the adaptive program at width 0",
              "model": target.name, "git_revision": git_revision(), "device": device_info(), "args": vars(args),
              "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
  for b, cap in ((b, c) for b in args.batch for c in args.capacity):
    rng = np.random.default_rng(0)
    toks, lens = pad_prompts([list(rng.integers(1, cfg.vocab_size - 1, 60)) for _ in range(b)])
    for name in args.speculators:
      sspec = speculator_spec.get(name)
      drafter = sspec.build(target, draft_params=DraftParams(n_max=4), **sspec.example(target, Path("/tmp")))
      dp = {k: jnp.asarray(a) for k, a in DraftParams(n_max=4).arrays(b, 4).items()}
      inp = RoundInputs(params=params, dparams=drafter.params(), sampling=SamplingParams.make(b), dp=dp,
                        stop_ids=jnp.asarray([-1], jnp.int32), max_new=jnp.full((b,), 10_000, jnp.int32))
      spec = RoundSpec(cfg=cfg, drafter=drafter)
      carry = prefill_request(spec, inp, jnp.asarray(toks), jnp.asarray(lens), capacity=cap, history_len=cap)
      copy = lambda c: jax.tree_util.tree_map(jnp.copy, c)

      def plain(n):
        out = _decode_loop(params, copy(carry.state), inp.sampling, inp.stop_ids, jnp.full((b,), n + 1, jnp.int32),
                           cfg=cfg)
        jax.block_until_ready(out.hist_len)

      row = {"batch": b, "capacity": cap, "speculator": name}
      row["plain_ms"], row["plain_call_ms"] = per_round_ms(plain, args.short, args.long, args.repeats)
      traced = {"plain": plain}
      alone = adapt.AdaptiveConfig(widths=(0,), segment_rounds=args.segments[0], explore_every=10 ** 6)

      def alone_run(n):
        out = adaptive_run(spec, inp, copy(carry), jnp.ones((1,), jnp.float32), jnp.int32(0), jnp.int32(n), ac=alone)
        jax.block_until_ready(out[1][3])

      row["width0_alone_ms"], row["width0_alone_call_ms"] = per_round_ms(alone_run, args.short, args.long, args.repeats)
      traced["width0_alone"] = alone_run
      for seg in args.segments:
        ac = adapt.AdaptiveConfig(segment_rounds=seg, explore_every=10 ** 6)
        widths = ac.widths_for(drafter.max_draft)
        costs = jnp.asarray([1.0] + [1e3] * (len(widths) - 1), jnp.float32)
        for mode, force in (("pinned", 0), ("chosen", -1)):
          if mode == "pinned" and seg != args.segments[0]:
            continue             # one segment whatever its configured length

          def spec_run(n, force=force, ac=ac, costs=costs):
            out = adaptive_run(spec, inp, copy(carry), costs, jnp.int32(force), jnp.int32(n), ac=ac)
            jax.block_until_ready(out[1][3])

          key = "width0_pinned_ms" if mode == "pinned" else f"width0_segments_of_{seg}_ms"
          row[key], row[key.replace("_ms", "_call_ms")] = per_round_ms(spec_run, args.short, args.long, args.repeats)
          if mode == "pinned":
            traced["width0_all_widths"] = spec_run
      if args.trace:
        row["trace"] = {label: trace_run(run, args.long) for label, run in traced.items()}
      print(json.dumps(row), flush=True)
      rows.append(row)
      save(rows)      # after each row: a run cut by a time limit keeps the rows it finished


if __name__ == "__main__":
  main()
