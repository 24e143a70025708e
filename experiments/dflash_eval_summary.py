"""One table and one figure from several `specjax train eval-dflash` result files (runs split over
GPU calls: each keeps its own plain-decoding baseline, so every speedup is against plain decoding
measured in the same call).

  python experiments/dflash_eval_summary.py \
      experiments/results/raw/dflash_gpu4_eval_7506288/dflash_gpu4_eval_mt_bench.json:0 \
      experiments/results/raw/dflash_gpu4_eval_7506288/dflash_gpu4_eval_mt_bench_t07.json \
      "experiments/results/raw/dflash_gpu4_eval_7506288/dflash_gpu4_deep_trees_mt_bench.json::mt_bench depth 12" \
      experiments/results/raw/dflash_gpu4_eval_7506288/dflash_gpu4_eval_humaneval.json \
      --out experiments/results/dflash_gpu4_eval_h200.json

Each argument is FILE[:TEMPERATURES[:LABEL]]: TEMPERATURES (comma-separated) keeps only those rows
(empty: all); LABEL renames the prompt set in the table (e.g. a run with other tree settings).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("files", nargs="+", help="FILE[:TEMPERATURES[:LABEL]]")
  ap.add_argument("--out", required=True)
  ap.add_argument("--title", default="")
  a = ap.parse_args(argv)
  from specjax.train.dflash_eval import format_eval, plot_eval
  results, sources = [], []
  for arg in a.files:
    path, _, rest = arg.partition(":")
    temps, _, label = rest.partition(":")
    keep = {float(t) for t in temps.split(",") if t}
    run = json.loads(Path(path).read_text())
    sources.append({"file": path, "git_revision": run["git_revision"], "device": run["device"],
                    "temperatures": sorted(keep) or "all", "label": label or None})
    for res in run["results"]:
      rows = [r for r in res["rows"] if not keep or r["temperature"] in keep]
      results.append({**res, "prompt_set": label or res["prompt_set"], "rows": rows, "source": path})
  kinds = sorted({s["device"]["device_kind"] for s in sources})
  out = {"results": results, "sources": sources, "devices": kinds,
         "git_revisions": sorted({s["git_revision"] for s in sources})}
  if len(kinds) == 1:   # one card for every run: its description, as a single eval-dflash file has
    out["device"] = sources[0]["device"]
  Path(a.out).parent.mkdir(parents=True, exist_ok=True)
  Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
  plot_eval(results, Path(a.out).with_suffix(".png"), title=a.title or f"DFlash and other drafters ({', '.join(kinds)})")
  print(format_eval(results))
  print(f"wrote {a.out} and {Path(a.out).with_suffix('.png')}")
  return out


if __name__ == "__main__":
  main()
