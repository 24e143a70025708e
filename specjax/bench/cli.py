"""`specjax bench` and `specjax report` subcommands."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def cmd_bench(args) -> int:
  from specjax.bench.config import ConfigError, load_config
  from specjax.bench.harness import run_experiment
  from specjax.bench.plots import plot_result
  try:
    cfg = load_config(args.config, limit=args.limit, dtype=args.dtype)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  result = run_experiment(cfg)
  out = Path(args.out or "experiments/results")
  out.mkdir(parents=True, exist_ok=True)
  stem = args.name or cfg.name
  (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
  plot_result(result, out / f"{stem}.png")
  from specjax.bench.report import report
  print(report([out / f"{stem}.json"]))
  print(f"wrote {out / (stem + '.json')} and {out / (stem + '.png')}", file=sys.stderr)
  return 0


def cmd_report(args) -> int:
  from specjax.bench.report import report
  print(report(args.results))
  return 0


def add_bench_commands(sub) -> None:
  b = sub.add_parser("bench", help="run an experiment config: plain decoding vs each method")
  b.add_argument("--config", required=True)
  b.add_argument("--out", default=None, help="output folder (default experiments/results)")
  b.add_argument("--name", default=None, help="file stem of the outputs (default: the config's name)")
  b.add_argument("--limit", type=int, default=None, help="override: questions per prompt set")
  b.add_argument("--dtype", default=None, help="override: float32 / bfloat16")
  b.set_defaults(func=cmd_bench)
  r = sub.add_parser("report", help="Markdown table comparing result JSON files")
  r.add_argument("results", nargs="+")
  r.set_defaults(func=cmd_report)
