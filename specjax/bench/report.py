"""`specjax report RESULT.json ...`: a Markdown table comparing runs side by side."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt(x, spec=".3f"):
  return "-" if x is None else format(x, spec)


def report(paths: list[str | Path]) -> str:
  lines = ["| experiment | device | method | prompts | tau | acceptance | tok/s | speedup | equal |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
  for p in paths:
    r = json.loads(Path(p).read_text())
    dev = r.get("device", {}).get("device_kind", "?")
    for method, s in r["summary"].items():
      o = s["overall"]
      lines.append(f"| {r['experiment']} | {dev} | {method} | {o['prompts']} | {_fmt(o['tau'])} | "
                   f"{_fmt(o['acceptance_rate'])} | {_fmt(o['tokens_per_s'], '.1f')} | {_fmt(o['speedup'])} | "
                   f"{_fmt(o['equal'], '.2f')} |")
  return "\n".join(lines)
