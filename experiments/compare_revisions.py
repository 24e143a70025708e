"""Compare two `specjax bench` results of the same config run with two revisions (old, new):
tokens/s, tau and the equality with plain greedy output per method, and new / old per method.

  python experiments/compare_revisions.py OLD.json NEW.json --out COMPARE.json [--tolerance 0.03]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def compare(old: dict, new: dict, tolerance: float) -> dict:
  rows = {}
  for method, o in old["summary"].items():
    n = new["summary"].get(method)
    if n is None:
      continue
    o, n = o["overall"], n["overall"]
    ratio = n["tokens_per_s"] / max(o["tokens_per_s"], 1e-9)
    rows[method] = {"old_tokens_per_s": o["tokens_per_s"], "new_tokens_per_s": n["tokens_per_s"],
                    "new_over_old": ratio, "within_tolerance": ratio >= 1 - tolerance,
                    "old_tau": o.get("tau"), "new_tau": n.get("tau"), "old_equal": o.get("equal"),
                    "new_equal": n.get("equal")}
  return {"old_revision": old.get("git_revision"), "new_revision": new.get("git_revision"),
          "device": new.get("device"), "config": new.get("config"), "tolerance": tolerance, "methods": rows,
          "all_within_tolerance": all(r["within_tolerance"] for r in rows.values())}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("old")
  ap.add_argument("new")
  ap.add_argument("--out", required=True)
  ap.add_argument("--tolerance", type=float, default=0.03, help="largest slowdown counted as no regression")
  a = ap.parse_args()
  res = compare(json.loads(Path(a.old).read_text()), json.loads(Path(a.new).read_text()), a.tolerance)
  Path(a.out).write_text(json.dumps(res, indent=1))
  for m, r in res["methods"].items():
    print(f"{m:22s} old {r['old_tokens_per_s']:8.1f}  new {r['new_tokens_per_s']:8.1f} tok/s  new/old {r['new_over_old']:.3f}"
          f"  tau {r['old_tau']} -> {r['new_tau']}")


if __name__ == "__main__":
  main()
