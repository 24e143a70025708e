"""`specjax tune`: search speculator, chain and draft parameters for the highest tokens/s.

  specjax tune --config configs/tune_smollm2_mt_bench.yaml
  specjax tune --config configs/tune_smollm2_mt_bench.yaml --seconds 600 --out experiments/results/tune_smollm2

Writes into --out (default experiments/results/<name>): best.yaml (a `specjax bench` config: plain
vs default vs tuned on the held-out questions), trials.json / trials.md / trials.png, holdout.json /
holdout.png, tune_prompts.jsonl / holdout_prompts.jsonl. Also runs as
`python -m specjax.bench.tune_cli --config ...`. User errors (a bad config, a budget no trial fits
in, a missing prompt set) are one line `error: ...` and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_tune(args) -> int:
  from specjax.tune import load_tune_config, run_tune, write_outputs
  tcfg = load_tune_config(args.config, limit=args.limit, dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                          seed=args.seed, strategy=args.strategy, trials=args.trials, seconds=args.seconds)
  log = (lambda s: print(s, file=sys.stderr)) if not args.quiet else None
  report = run_tune(tcfg, progress=not args.quiet, log=log)
  out = Path(args.out or Path("experiments/results") / tcfg.name)
  paths = write_outputs(report, out)
  print(paths["trials_md"].read_text())
  print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
  return 0


def add_tune_commands(sub) -> None:
  t = sub.add_parser("tune", help="search speculators, chains and draft parameters for the best tokens/s")
  t.add_argument("--config", required=True, help="tune config (a bench config plus a `tune:` section)")
  t.add_argument("--out", default=None, help="output folder (default experiments/results/<name>)")
  t.add_argument("--trials", type=int, default=None, help="override: candidates to try (the default included)")
  t.add_argument("--seconds", type=float, default=None, help="override: wall-time budget of the search")
  t.add_argument("--seed", type=int, default=None, help="override: seed of the split and the candidates")
  t.add_argument("--strategy", choices=("random", "halving"), default=None, help="override: search strategy")
  t.add_argument("--limit", type=int, default=None, help="override: questions per prompt set (before the split)")
  t.add_argument("--dtype", default=None, help="override: float32 / bfloat16")
  t.add_argument("--max-new-tokens", type=int, default=None, help="override: tokens per answer")
  t.add_argument("--quiet", action="store_true", help="no progress bar or per-trial log")
  t.set_defaults(func=cmd_tune)


def _user_errors() -> tuple:
  """What the user can fix (a config, a budget, a missing file): one line, exit 2."""
  from specjax.bench.config import ConfigError
  from specjax.errors import UserError
  from specjax.io.fetch import FetchError
  from specjax.tune.config import TuneError
  return (UserError, ConfigError, FetchError, TuneError, FileNotFoundError)


def main(argv=None) -> int:
  class Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, exit 2, as `specjax`
      print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
      sys.exit(2)

  ap = Parser(prog="specjax")
  sub = ap.add_subparsers(dest="cmd", required=True)
  add_tune_commands(sub)
  args = ap.parse_args(["tune", *(sys.argv[1:] if argv is None else argv)])
  try:
    return args.func(args)
  except _user_errors() as e:
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
  sys.exit(main())
