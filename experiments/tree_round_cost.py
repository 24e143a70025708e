"""What a round of each method of a `specjax bench` result costs, and a tree round against a chain round.

Reads one or more bench JSONs (e.g. `configs/bench_tree_vs_chain_smollm2_b1.yaml` run with and
without the path-move kernel, SPECJAX_COMPACT_PATH=xla) and prints, per file and method: prompts, tau, tok/s, ms per
round (the batches' seconds over their rounds, a batch running as many rounds as its longest row,
prefill included) and the least-squares slope of a batch's seconds against its rounds (ms per
extra round, the prefill and other per-batch costs in the intercept); plain decoding's rounds are
its decode steps (new tokens - 1). Then, for
each `TREE_PAIRS` pair present, the tree's ms per round over the chain's. --out writes it as JSON.

  python experiments/tree_round_cost.py OUT/tree_vs_chain_smollm2_b1.json [OUT2/...json] --out summary.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

TREE_PAIRS = (("eagle3_tree_32", "eagle3_chain_6"), ("dflash_tree_32", "dflash_chain_8"))


def method_costs(result: dict) -> dict:
  """{method: {prompts, tau, tokens_per_s, ms_per_round, ms_per_extra_round}} of one bench result.
  A batch's rows share its seconds (`batch_seconds`) and run as many rounds as its longest row."""
  out = {}
  for method, rows in result["prompts"].items():
    rounds_of = lambda r: r["rounds"] if method != "plain" else max(r["new_tokens"] - 1, 0)
    batches: dict = {}
    for r in rows:
      batches.setdefault(r["batch_seconds"], []).append(r)
    secs = np.asarray(list(batches), np.float64)                                    # [batches]
    rounds = np.asarray([max(rounds_of(r) for r in b) for b in batches.values()], np.float64)
    toks = sum(r["new_tokens"] for r in rows)
    slope = float(np.polyfit(rounds, secs, 1)[0]) if len(secs) > 2 and np.ptp(rounds) > 0 else float("nan")
    out[method] = {"prompts": len(rows), "batches": len(secs),
                   "tau": float(toks / max(sum(rounds_of(r) for r in rows), 1)) if method != "plain" else 1.0,
                   "tokens_per_s": float(toks / secs.sum()), "ms_per_round": 1e3 * float(secs.sum() / rounds.sum()),
                   "ms_per_extra_round": 1e3 * slope}
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("results", nargs="+", help="bench JSON files")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  summary = {}
  for path in args.results:
    result = json.loads(Path(path).read_text())
    costs = method_costs(result)
    pairs = {f"{t} / {c}": costs[t]["ms_per_round"] / costs[c]["ms_per_round"] for t, c in TREE_PAIRS
             if t in costs and c in costs}
    env = (result.get("environment") or {})
    summary[path] = {"git_revision": result.get("git_revision"), "device": result.get("device"),
                     "environment": env, "methods": costs, "tree_over_chain_ms_per_round": pairs}
    print(f"{path} ({result.get('git_revision')}, {(result.get('device') or {}).get('device_kind')})")
    print(f"  {'method':18s} {'prompts':>7s} {'tau':>5s} {'tok/s':>8s} {'ms/round':>9s} {'ms/extra round':>15s}")
    for m, c in costs.items():
      print(f"  {m:18s} {c['prompts']:7d} {c['tau']:5.2f} {c['tokens_per_s']:8.0f} {c['ms_per_round']:9.3f} "
            f"{c['ms_per_extra_round']:15.3f}")
    for name, r in pairs.items():
      print(f"  {name}: {r:.3f}x a round")
  if args.out:
    Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
  main()
