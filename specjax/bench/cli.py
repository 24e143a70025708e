"""`specjax bench` and `specjax report` subcommands.

A bench run writes its result JSON as rows complete (and a rows journal beside it); a run that was
killed or interrupted continues with `specjax bench --config X --resume`. User errors (a bad config
or result file) are one line `error: ...` and exit 2, before any model is loaded.
"""

from __future__ import annotations

import sys
from pathlib import Path


def cmd_bench(args) -> int:
  from specjax.bench.config import load_config
  from specjax.bench.harness import run_experiment
  from specjax.bench.journal import journal_path
  from specjax.bench.plots import plot_result
  from specjax.bench.report import report
  cfg = load_config(args.config, limit=args.limit, dtype=args.dtype, mesh=args.mesh)
  out = Path(args.out or "experiments/results")
  stem = args.name or cfg.name
  out.mkdir(parents=True, exist_ok=True)
  path = out / f"{stem}.json"
  try:
    result = run_experiment(cfg, out=path, resume=args.resume)
  except KeyboardInterrupt:
    if journal_path(path).exists():
      print(f"interrupted: the completed rows are in {path}; continue with --resume", file=sys.stderr)
    raise
  plot_result(result, out / f"{stem}.png")
  print(report([path]))
  print(f"wrote {path} and {out / (stem + '.png')}", file=sys.stderr)
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
  b.add_argument("--mesh", default=None, metavar="data=D,model=M",
                 help="override: shard the target over D x M devices (data: batch, model: heads / MLP / vocabulary)")
  b.add_argument("--resume", action="store_true",
                 help="continue an interrupted run of this config into the same output, running only the rows it lacks")
  b.set_defaults(func=cmd_bench)
  r = sub.add_parser("report", help="Markdown table comparing result JSON files")
  r.add_argument("results", nargs="+")
  r.set_defaults(func=cmd_report)
