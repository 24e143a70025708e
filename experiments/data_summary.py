"""What a self-distillation data build holds: per data folder its shards, rows and response tokens,
and for Magpie folders how many queries the target wrote were kept or rejected (by reason).

  python experiments/data_summary.py --config configs/train_mtp_smollm2_gpu.yaml --out summary.json out/mtp_gpu2/data_*

(experiments/gpu/train_head.sh data ... runs it after the build.)"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.bench.env import device_info, git_revision  # noqa: E402


def folder_summary(d: Path) -> dict:
  man = json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").exists() else {"shards": []}
  res = {"shards": len(man["shards"]), "rows": sum(s["rows"] for s in man["shards"]),
         "response_tokens": sum(s["response_tokens"] for s in man["shards"])}
  for cache in sorted(d.glob("magpie_prompts_*.jsonl")):
    batches = [json.loads(line) for line in cache.read_text().splitlines()[1:]]
    rejected: dict = {}
    for b in batches:
      for k, v in b["rejected"].items():
        rejected[k] = rejected.get(k, 0) + v
    res[cache.name] = {"batches": len(batches), "kept": sum(len(b["queries"]) for b in batches), "rejected": rejected}
  return res


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("folders", nargs="+", help="data folders (each with manifest.json)")
  ap.add_argument("--config", required=True, help="the training spec that built them (recorded)")
  ap.add_argument("--out", required=True, help="JSON file to write")
  args = ap.parse_args()
  res = {"config": args.config, "git_revision": git_revision(), "device": device_info(),
         "folders": {d: folder_summary(Path(d)) for d in args.folders}}
  Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
  print(json.dumps(res["folders"], indent=1))


if __name__ == "__main__":
  main()
