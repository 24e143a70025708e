"""How acceptance falls along a chain: for one method of a bench config (fixed draft length, not
adaptive), batch by batch, the drafts accepted at each chain position over the rounds, and the
conditional rate of position p (accepted at p / accepted at p - 1; position 1: over the rounds that
drafted). A censored-geometric estimate (the device loop's model for chain heads) assumes that rate
is one alpha for every position; if the first position's rate stands for the later ones, a
first-draft hit rate observed without verifying drafts (e.g. while backing off to plain decoding)
can stand in for exploring rounds.

  python experiments/acceptance_by_position.py --config configs/bench_adaptive_heads_smollm2_b8.yaml --method mtp \
      --batches 4 --new-tokens 64 --out experiments/results/acceptance_by_position_mtp_cpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specjax.bench.config import DEFAULT_CAPACITY, load_config
from specjax.bench.env import device_info, git_revision
from specjax.bench.harness import load_questions, load_target
from specjax.bench.runner import Runner, _encode, _messages
from specjax.engine import speculative_generate


def conditional_rates(accepted_by_pos: list[int], rounds_drafting: int) -> list[float | None]:
  """Accepted at position p over accepted at p - 1 (position 1: over the rounds that drafted)."""
  out, before = [], rounds_drafting
  for a in accepted_by_pos:
    out.append(round(a / before, 4) if before else None)
    before = a
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", required=True)
  ap.add_argument("--method", required=True, help="a method name of the config (run with its draft length, not adaptive)")
  ap.add_argument("--batches", type=int, default=4)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  cfg = load_config(args.config)
  questions = load_questions(cfg)
  target = load_target(cfg)
  method = next((m for m in cfg.methods if m.name == args.method), None)
  if method is None:
    raise SystemExit(f"{args.config} has no method {args.method!r}")
  runner = Runner(cfg, target, method, {})
  stop = tuple(target.tokenizer.eos_ids) if target.tokenizer is not None else ()
  rows = []
  for start in range(0, min(len(questions), args.batches * cfg.batch_size), cfg.batch_size):
    batch = questions[start: start + cfg.batch_size]
    prompts = [_encode(cfg, target.tokenizer, _messages(q, [], 0)) for q in batch]
    r = speculative_generate(target.params, target.cfg, prompts, runner.drafter, draft_params=runner.draft_params,
                             max_new_tokens=args.new_tokens, stop_ids=stop, capacity=cfg.capacity or DEFAULT_CAPACITY)
    st = r.stats
    drafting = max(st.drafted_by_pos) if st.drafted_by_pos else 0
    row = {"batch": start // cfg.batch_size, "questions": [q.question_id for q in batch],
           "categories": sorted({q.category for q in batch if getattr(q, "category", None)}), "tau": round(st.tau, 4),
           "accepted_by_pos": st.accepted_by_pos, "drafted_by_pos": st.drafted_by_pos,
           "conditional_rate": conditional_rates(st.accepted_by_pos, drafting)}
    print(json.dumps(row), flush=True)
    rows.append(row)
    result = {"what": "accepted drafts by chain position and the conditional rate per position, fixed draft length",
              "config": args.config, "method": args.method, "new_tokens": args.new_tokens,
              "git_revision": git_revision(), "device": device_info(), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
