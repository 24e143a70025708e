"""Autoregressive decode speed of a real model at several batch sizes (issue 2's benchmark).

  python experiments/bench_decode.py --model smollm2-135m-instruct --dtype bfloat16 \
      --batch 1 8 64 --new-tokens 256 --out experiments/results/decode_smollm2_h100.json

Prompts are MT-bench first turns (chat template, `specjax.bench.prompts`); every sequence generates
exactly --new-tokens tokens (stop tokens ignored) so tokens/s compares like with like. Compile
and a warm-up run are excluded; the median of --repeats timed runs is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.bench.env import device_info, environment, git_revision  # noqa: E402
from specjax.bench.prompts import load_prompt_set  # noqa: E402
from specjax.engine.decode import generate_plain  # noqa: E402
from specjax.models.load import load_model  # noqa: E402


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
  ap.add_argument("--new-tokens", type=int, default=256)
  ap.add_argument("--capacity", type=int, default=1024)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--unroll", type=int, nargs="+", default=[1], help="decode steps per loop iteration")
  ap.add_argument("--prompts", default=None, help="prompt file (default: MT-bench, fetched like the models)")
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)

  model = load_model(args.model, dtype=jnp.dtype(args.dtype))
  tok = model.tokenizer
  questions = load_prompt_set(args.prompts)
  prompts_all = [tok.encode_chat([{"role": "user", "content": q.turns[0]}]) for q in questions]
  rows = []
  for unroll in args.unroll:
    for b in args.batch:
      prompts = [prompts_all[i % len(prompts_all)] for i in range(b)]
      run = lambda: generate_plain(model.params, model.cfg, prompts, max_new_tokens=args.new_tokens,
                                   capacity=args.capacity, unroll=unroll)
      run()   # compile + warm-up
      runs = [run() for _ in range(args.repeats)]
      secs = statistics.median(r.seconds for r in runs)
      n = runs[0].n_generated
      rows.append({"batch": b, "unroll": unroll, "new_tokens_per_seq": args.new_tokens, "tokens": n,
                   "seconds": secs, "tokens_per_s": n / secs, "ms_per_step": secs / args.new_tokens * 1e3,
                   "all_seconds": [r.seconds for r in runs]})
      print(f"unroll {unroll} batch {b:4d}: {n / secs:10.1f} tok/s  ({secs / args.new_tokens * 1e3:.3f} ms/step "
            "incl. prefill)", flush=True)
  result = {"experiment": "decode_speed", "config": vars(args), "model_config": repr(model.cfg),
            "git_revision": git_revision(), "device": device_info(), "environment": environment(),
            "results": rows}
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
