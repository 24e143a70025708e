"""Summarize engine no-regression runs (experiments/gpu/engine_regression.sh): per batch size and
method, tokens/s of the old and the new revision over the prompts BOTH finished (a run cut by its
time limit keeps the rows it finished), new / old, tau and the share of prompts whose output
equals plain greedy output. Inputs are `specjax bench` row journals (*.rows.jsonl) or result JSONs
(their `prompts` rows), named *_old.* / *_new.*; a method measured in several files keeps the
file with the most rows.

  python experiments/engine_regression_summary.py experiments/results/raw/engine_regression_h100/* \\
      --out experiments/results/engine_regression_smollm2_h100.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path


def _rows(path: Path) -> tuple[dict, list[dict]]:
  if path.name.endswith(".rows.jsonl"):
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return lines[0], [r for r in lines[1:] if "method" in r]
  d = json.loads(path.read_text())
  return d, [r for rows in d["prompts"].values() for r in rows]


def collect(paths):
  """-> {(batch, which): {method: rows}}, {which: revision}, device."""
  runs, revs, device = collections.defaultdict(dict), {}, None
  for p in map(Path, paths):
    m = re.search(r"_b(\d+).*_(old|new)\.(rows\.jsonl|json)$", p.name)
    if not m:
      continue
    head, rows = _rows(p)
    revs[m.group(2)], device = head.get("git_revision"), head.get("device") or device
    by = collections.defaultdict(list)
    for r in rows:
      by[r["method"]].append(r)
    for method, rs in by.items():
      slot = runs[(int(m.group(1)), m.group(2))]
      if len(rs) > len(slot.get(method, [])):
        slot[method] = rs
  return runs, revs, device


def _stats(rows):
  tok, sec = sum(r["new_tokens"] for r in rows), sum(r["seconds"] for r in rows)
  rounds = sum(r.get("rounds", 0) for r in rows)
  eq = [r["equal_to_plain"] for r in rows if r.get("equal_to_plain") is not None]
  return {"tokens_per_s": tok / sec if sec else None,
          "tau": sum(r.get("emitted", 0) for r in rows) / rounds if rounds else None,
          "equal": sum(eq) / len(eq) if eq else None}


def summarize(runs) -> dict:
  out = {}
  for batch in sorted({b for b, _ in runs}):
    old, new = runs.get((batch, "old"), {}), runs.get((batch, "new"), {})
    table = {}
    for method in old.keys() & new.keys():
      key = lambda r: (r["question_id"], r["turn"])
      common = {key(r) for r in old[method]} & {key(r) for r in new[method]}
      if not common:
        continue
      o = _stats([r for r in old[method] if key(r) in common])
      n = _stats([r for r in new[method] if key(r) in common])
      table[method] = {"prompts": len(common), "old": o, "new": n,
                       "new_over_old": n["tokens_per_s"] / o["tokens_per_s"]}
    out[f"batch_{batch}"] = table
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("files", nargs="+")
  ap.add_argument("--out", required=True)
  a = ap.parse_args()
  runs, revs, device = collect(a.files)
  res = {"experiment": "engine_regression", "old_revision": revs.get("old"), "new_revision": revs.get("new"),
         "device": device, "inputs": sorted(Path(f).name for f in a.files), "by_batch": summarize(runs)}
  Path(a.out).write_text(json.dumps(res, indent=1))
  for batch, table in res["by_batch"].items():
    for m, r in sorted(table.items()):
      print(f"{batch:8s} {m:20s} n={r['prompts']:3d} old {r['old']['tokens_per_s']:8.1f} new {r['new']['tokens_per_s']:8.1f}"
            f" tok/s  new/old {r['new_over_old']:.3f}  tau {r['old']['tau']} -> {r['new']['tau']}")


if __name__ == "__main__":
  main()
