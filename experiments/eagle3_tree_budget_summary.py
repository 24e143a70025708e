"""Summary of experiments/eagle3_tree_budget.sh: tree tau (and the chain's) against the node budget."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("results", nargs="+")
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  rows, chain = [], None
  for path in args.results:
    res = json.loads(Path(path).read_text())
    for r in res["results"]:
      if r["kind"] == "tree":
        rows.append({k: r.get(k) for k in ("depth", "top_k", "budget", "tau", "acceptance_by_pos")})
      elif r["kind"] == "chain" and chain is None:
        chain = {k: r.get(k) for k in ("n_max", "tau", "acceptance_by_pos")}
    meta = {k: res.get(k) for k in ("git_revision", "device", "config")}
  rows.sort(key=lambda r: r["budget"])
  summary = {"experiment": "eagle3_tree_budget", **meta, "trees": rows, "chain": chain}
  Path(args.out).write_text(json.dumps(summary, indent=1))
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.plot([r["budget"] for r in rows], [r["tau"] for r in rows], "o-", label="EAGLE-2 tree")
  for r in rows:
    ax.annotate(f"d{r['depth']} k{r['top_k']}", (r["budget"], r["tau"]), fontsize=7, textcoords="offset points",
                xytext=(3, -10))
  if chain:
    ax.axhline(chain["tau"], ls="--", color="gray", label=f"chain n_max {chain['n_max']}")
  ax.axhline(3.0, ls=":", color="red", label="issue 8 bar")
  ax.set(xlabel="tree node budget", ylabel="tau (tokens / round)", title="EAGLE-3 head, MT-bench q1-16, greedy")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(Path(args.out).with_suffix(".png"), dpi=120)
  for r in rows:
    print(f"tree d{r['depth']} k{r['top_k']} budget {r['budget']}: tau {r['tau']:.3f}")
  if chain:
    print(f"chain n_max {chain['n_max']}: tau {chain['tau']:.3f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
