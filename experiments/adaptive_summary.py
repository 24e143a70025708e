"""Issue 11's adaptive-drafting claims from the bench results of configs/adaptive_smollm2_b*.yaml:
adaptive within 5% of the best fixed draft length at every batch size, and faster than fixed
n_max = 8 at batch 32 and 64. Writes one JSON (numbers + verdicts) and a bar chart.

  python experiments/adaptive_summary.py experiments/results/adaptive_smollm2_b{1,32,64}.json \
      --out experiments/results/adaptive_smollm2_summary.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("results", nargs="+")
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  rows = []
  for path in args.results:
    d = json.loads(Path(path).read_text())
    s = {k: v["overall"] for k, v in d["summary"].items()}
    # plain decoding is the fixed setting n_max = 0: at batch 64 on an H100 it is the best one
    fixed = {k: v["tokens_per_s"] for k, v in s.items() if k.startswith("fixed_") or k == "plain"}
    best = max(fixed, key=fixed.get)
    ad = s["adaptive"]["tokens_per_s"]
    b = d["config"]["batch_size"]
    rows.append({"batch": b, **{k: v for k, v in fixed.items()},
                 "adaptive": ad, "adaptive_tau": s["adaptive"]["tau"], "best_fixed": best,
                 "adaptive_over_best_fixed": ad / fixed[best], "adaptive_over_fixed_n8": ad / fixed["fixed_n8"],
                 "within_5pct_of_best": ad >= 0.95 * fixed[best],
                 "faster_than_n8": ad > fixed["fixed_n8"], "device": d["device"].get("device_kind"),
                 "git_revision": d.get("git_revision"), "source": str(path)})
  rows.sort(key=lambda r: r["batch"])
  out = {"experiment": "adaptive_drafting", "rows": rows,
         "never_more_than_5pct_slower": all(r["within_5pct_of_best"] for r in rows),
         "faster_than_n8_at_32_and_64": all(r["faster_than_n8"] for r in rows if r["batch"] in (32, 64))}
  Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = ["plain", "fixed_n2", "fixed_n4", "fixed_n8", "adaptive"]
  fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.6), squeeze=False)
  for ax, r in zip(axes[0], rows):
    vals = [r[n] for n in names]
    ax.bar(names, vals, color=["gray", "tab:blue", "tab:blue", "tab:blue", "tab:orange"])
    ax.set_title(f"batch {r['batch']}")
    ax.set_ylabel("tokens/s")
    ax.tick_params(axis="x", rotation=45)
  fig.suptitle(f"adaptive drafting vs fixed n_max (ngram_simple, SmolLM2, {rows[0]['device']})")
  fig.tight_layout()
  fig.savefig(Path(args.out).with_suffix(".png"), dpi=110)
  print(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
