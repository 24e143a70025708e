"""`specjax report RESULT.json ...`: a Markdown table comparing runs side by side.

tok/s is the figure the summary uses (each batch's fastest repeat); with several repeats the
range over repeats (min-max) follows it. A result written by an interrupted run is marked partial.
"""

from __future__ import annotations

import json
from pathlib import Path

from specjax.errors import UserError


def _fmt(x, spec=".3f"):
  return "-" if x is None else format(x, spec)


def _read(path) -> dict:
  """A bench result file, or a one-line UserError saying why it is not one."""
  path = Path(path)
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except FileNotFoundError:
    raise UserError(f"{path}: no such result file") from None
  except (OSError, UnicodeDecodeError) as e:
    raise UserError(f"{path}: cannot read it ({type(e).__name__})") from None
  except ValueError as e:
    raise UserError(f"{path}: not a JSON file ({e})") from None
  summary = data.get("summary") if isinstance(data, dict) else None
  if not isinstance(summary, dict) or not all(isinstance(s, dict) and isinstance(s.get("overall"), dict)
                                              for s in summary.values()):
    raise UserError(f"{path}: not a bench result (no per-method summary); `specjax report` reads the JSON "
                    "of `specjax bench` (or a tune run's holdout.json)")
  return data


def _tok_s(o: dict) -> str:
  text = _fmt(o.get("tokens_per_s"), ".1f")
  spread = o.get("repeat_spread")
  if spread and spread.get("n", 1) > 1:
    t = spread["tokens_per_s"]
    text += f" ({t['min']:.1f}-{t['max']:.1f})"
  return text


def report(paths: list[str | Path]) -> str:
  lines = ["| experiment | device | method | prompts | tau | acceptance | tok/s | speedup | equal |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
  for p in paths:
    r = _read(p)
    dev = (r.get("device") or {}).get("device_kind", "?")
    name = str(r.get("experiment", Path(p).stem)) + ("" if r.get("complete", True) else " (partial)")
    for method, s in r["summary"].items():
      o = s["overall"]
      lines.append(f"| {name} | {dev} | {method} | {o.get('prompts', '-')} | {_fmt(o.get('tau'))} | "
                   f"{_fmt(o.get('acceptance_rate'))} | {_tok_s(o)} | {_fmt(o.get('speedup'))} | "
                   f"{_fmt(o.get('equal'), '.2f')} |")
  return "\n".join(lines)
