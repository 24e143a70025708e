"""`specjax train ...`: build self-distillation data and train drafter heads from one YAML config.

  specjax train data --config configs/train_mtp_smollm2.yaml                 # resumable; progress bar
  specjax train mtp  --config configs/train_mtp_smollm2.yaml                 # resumes from checkpoints
  specjax train mtp  --config configs/train_mtp_smollm2.yaml --dtype bfloat16 --steps 4000   # on a GPU
  specjax train eval-mtp --config configs/train_mtp_smollm2.yaml --n-max 1,2,3,4   # tau on MT-bench
  specjax generate --spec mtp --head assets/smollm2/mtp/mtp_head.safetensors --n-max 3 --chat "..."
  specjax train eagle3 --config configs/train_eagle3_smollm2.yaml        # data (if missing) + TTT training + export
  specjax train eval-eagle3 --config configs/train_eagle3_smollm2.yaml --out out/eagle3_eval.json
  specjax train dflash --config configs/train_dflash_smollm2.yaml --data-seconds 90 --train-seconds 150
  specjax train eval-dflash --config configs/train_dflash_smollm2.yaml --out out/dflash_eval.json
"""

from __future__ import annotations

import json
import time


def _overrides(args) -> dict:
  return {"dtype": args.dtype, "train.steps": getattr(args, "steps", None),
          "data.n_sequences": getattr(args, "n_sequences", None), "data.dir": getattr(args, "data_dir", None),
          "out_dir": getattr(args, "out_dir", None), "export": getattr(args, "export", None),
          "loss.batch_size": getattr(args, "batch_size", None)}


def _data_spec(path, overrides):
  """The training spec of `path`, whichever head it trains (MTP, EAGLE-3 or DFlash: the first
  loader that accepts its keys; the MTP loader's error when none does)."""
  import importlib
  from specjax.bench.config import ConfigError
  first = None
  for kind in ("mtp", "eagle3", "dflash"):
    try:
      return importlib.import_module(f"specjax.train.{kind}").load_spec(path, **overrides)
    except ConfigError as e:
      first = first or e
  raise first


def cmd_data(args) -> int:
  from specjax.models.load import load_model
  from specjax.train.data import ShardDataset, build_dataset
  spec = _data_spec(args.config, _overrides(args))
  target = load_model(spec.target, dtype=spec.dtype)
  held = tuple(getattr(spec, "heldout_data", ()))
  for dc in (spec.data,) + (() if args.main_only else tuple(spec.extra_data) + held):
    out = build_dataset(target, dc, progress=not args.quiet, dtype_name=spec.dtype)
    ds = ShardDataset(out)
    print(f"{out}: {len(ds)} rows ({dc.responses} answers), {ds.n_response_tokens} answer tokens, "
          f"{int(ds.arrays['lens'].sum())} tokens in all, taps {'stored' if ds.has_taps else 'not stored'}")
  return 0


def cmd_mtp(args) -> int:
  from specjax.train.mtp import load_spec, run_training
  spec = load_spec(args.config, **_overrides(args))
  summary = run_training(spec, resume=not args.no_resume, progress=not args.quiet)
  print(json.dumps({k: summary[k] for k in ("name", "steps", "final_metrics", "seconds_this_run")
                    + (("export",) if "export" in summary else ())}, indent=1))
  return 0


def cmd_eval(args) -> int:
  import jax.numpy as jnp

  from specjax.models.load import load_model
  from specjax.train.mtp import evaluate_head, load_spec
  spec = load_spec(args.config, **_overrides(args))
  head = args.head or spec.export
  target = load_model(spec.target, dtype=jnp.dtype(spec.dtype))
  res = evaluate_head(target, head, prompt_set=args.prompts, per_category=args.per_category,
                      n_max=tuple(int(x) for x in args.n_max.split(",")), max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, batch_size=args.batch_size, progress=not args.quiet)
  res["config"] = args.config
  if args.out:
    from pathlib import Path
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
  return 0


def add_train_commands(subparsers) -> None:
  t = subparsers.add_parser("train", help="build self-distillation data and train drafter heads")
  tsub = t.add_subparsers(dest="train_cmd", required=True)

  def common(p):
    p.add_argument("--config", required=True, help="YAML config (e.g. configs/train_mtp_smollm2.yaml)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="target / compute dtype (default: the config's; bfloat16 on GPU)")
    p.add_argument("--data-dir", default=None, help="dataset folder (default: the config's data.dir)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")

  d = tsub.add_parser("data", help="the target answers training prompts: token shards (+ taps)")
  common(d)
  d.add_argument("--n-sequences", type=int, default=None, help="rows of the main dataset (default: the config's)")
  d.add_argument("--main-only", action="store_true", help="build the main dataset only, not extra_data")
  d.set_defaults(func=cmd_data)

  m = tsub.add_parser("mtp", help="train MTP heads on a built dataset and export them")
  common(m)
  m.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the config's)")
  m.add_argument("--batch-size", type=int, default=None, help="rows per step (default: the config's)")
  m.add_argument("--out-dir", default=None, help="checkpoints + metrics.jsonl (default: the config's)")
  m.add_argument("--export", default=None, help="where to write the head (default: the config's)")
  m.add_argument("--no-resume", action="store_true", help="start over even if checkpoints exist")
  m.set_defaults(func=cmd_mtp)

  e = tsub.add_parser("eval-mtp", help="tau and acceptance by position of a trained head (quick check)")
  common(e)
  e.add_argument("--head", default=None, help="head file (default: the config's export)")
  e.add_argument("--prompts", default="mt_bench", help="prompt set (first turns)")
  e.add_argument("--per-category", type=int, default=1, help="questions per category")
  e.add_argument("--n-max", default="1,2,3,4", help="comma-separated draft lengths")
  e.add_argument("--max-new-tokens", type=int, default=128)
  e.add_argument("--temperature", type=float, default=0.0)
  e.add_argument("--batch-size", type=int, default=None, help="prompts per call (default: all at once)")
  e.add_argument("--out", default=None, help="write the result JSON here")
  e.set_defaults(func=cmd_eval)
  add_eagle3_commands(tsub, common)
  add_dflash_commands(tsub, common)


# ----------------------------------------------------------------------------------------------
# EAGLE-3 heads


def cmd_eagle3(args) -> int:
  from specjax.train.eagle3 import load_spec, run_training
  spec = load_spec(args.config, **_overrides(args), time_budget_s=args.time_budget)
  summary = run_training(spec, resume=not args.no_resume, progress=not args.quiet)
  print(json.dumps({k: summary[k] for k in ("name", "steps", "final_metrics", "seconds_this_run", "data_seconds")
                    + (("export",) if "export" in summary else ())}, indent=1))
  return 0


def cmd_eval_eagle3(args) -> int:
  from pathlib import Path

  import jax.numpy as jnp

  from specjax.models.load import load_model
  from specjax.train.eagle3 import load_spec
  from specjax.train.eagle3_eval import evaluate_eagle3, plot_eval
  spec = load_spec(args.config, dtype=args.dtype)
  target = load_model(spec.target, dtype=jnp.dtype(spec.dtype))
  depth, top_k, budget = (int(x) for x in args.tree.split(","))
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  save = lambda res: out.write_text(json.dumps({**res, "config": args.config}, indent=1) + "\n")   # partial results too
  res = evaluate_eagle3(target, args.head or spec.export, prompt_set=args.prompts, n_questions=args.n_questions,
                        n_max=tuple(int(x) for x in args.n_max.split(",")),
                        tree={"depth": depth, "top_k": top_k, "budget": budget},
                        temperatures=tuple(float(x) for x in args.temperatures.split(",")),
                        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, mtp_head=args.mtp_head,
                        progress=not args.quiet, on_result=save)
  save(res)
  plot_eval(res, out.with_suffix(".png"))
  print(f"wrote {out} and {out.with_suffix('.png')}")
  return 0


def add_eagle3_commands(tsub, common) -> None:
  a = tsub.add_parser("eagle3", help="build the data if needed, train an EAGLE-3 head (training-time test), export it")
  common(a)
  a.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the config's)")
  a.add_argument("--batch-size", type=int, default=None, help="rows per step (default: the config's)")
  a.add_argument("--n-sequences", type=int, default=None, help="rows of the main dataset (default: the config's)")
  a.add_argument("--time-budget", type=float, default=None,
                 help="cap the steps so training takes about this many seconds (timed after compilation)")
  a.add_argument("--out-dir", default=None, help="checkpoints + metrics.jsonl (default: the config's)")
  a.add_argument("--export", default=None, help="where to write the head (default: the config's)")
  a.add_argument("--no-resume", action="store_true", help="start over even if checkpoints exist")
  a.set_defaults(func=cmd_eagle3)

  e = tsub.add_parser("eval-eagle3", help="tau, acceptance and tokens/s of an EAGLE-3 head: chains and trees")
  common(e)
  e.add_argument("--head", default=None, help="head file (default: the config's export)")
  e.add_argument("--prompts", default="mt_bench", help="prompt set (first turns)")
  e.add_argument("--n-questions", type=int, default=16, help="first N questions")
  e.add_argument("--n-max", default="1,2,3,4,5", help="comma-separated chain lengths")
  e.add_argument("--tree", default="6,8,48", help="depth,top_k,n_nodes (the node budget) of the tree drafter")
  e.add_argument("--temperatures", default="0,0.7")
  e.add_argument("--max-new-tokens", type=int, default=128)
  e.add_argument("--batch-size", type=int, default=8)
  e.add_argument("--mtp-head", default=None, help="also run this MTP head's chain (comparison)")
  e.add_argument("--out", required=True, help="result JSON (and a PNG next to it)")
  e.set_defaults(func=cmd_eval_eagle3)


# ----------------------------------------------------------------------------------------------
# DFlash drafters


def cmd_dflash(args) -> int:
  import jax.numpy as jnp

  from specjax.models.load import load_model
  from specjax.train.dflash import load_spec
  from specjax.train.dflash_run import build_budgeted, build_data, run_training
  t_start = time.perf_counter()
  spec = load_spec(args.config, **_overrides(args), train_seconds=args.train_seconds)
  target = load_model(spec.target, dtype=jnp.dtype(spec.dtype), progress=not args.quiet)
  t0 = time.perf_counter()
  built = None
  if not args.no_data and (spec.data_budget_s is not None or spec.heldout_data):   # held-out sets, then what fits
    spec, built = build_budgeted(spec, target, progress=not args.quiet)
  elif not args.no_data:   # resumable: shards already built are kept
    build_data(target, (spec.data,) + spec.extra_data, seconds=args.data_seconds, progress=not args.quiet,
               dtype_name=spec.dtype)
  data_s = time.perf_counter() - t0
  summary = run_training(spec, target=target, resume=not args.no_resume, progress=not args.quiet, t_start=t_start,
                         data_log={"seconds": round(data_s, 1), "built": built})
  summary["data_seconds"] = round(data_s, 1)
  print(json.dumps({k: summary[k] for k in ("name", "steps", "final_metrics", "seconds_this_run", "data_seconds")
                    + (("export",) if "export" in summary else ())}, indent=1))
  return 0


_EVAL_DFLASH_ARGS = ("config", "dtype", "head", "prompts", "n_questions", "n_max", "tree", "tree_depth",
                     "tree_top_k", "temperatures", "max_new_tokens", "batch_size", "repeats", "mtp_head",
                     "eagle3_head", "eagle3_tree")


def _eval_dflash_resume(path, out: dict, keys=("args", "environment", "files")) -> dict:
  """{prompt set: its result} of an interrupted `eval-dflash` into `path`, after checking that it
  ran the same arguments in the same environment on the same files, as far as `out` says them
  (`keys`; else a one-line UserError)."""
  from pathlib import Path

  from specjax.bench import env
  from specjax.errors import UserError
  path = Path(path)
  if not path.exists():
    return {}
  try:
    prev = json.loads(path.read_text())
  except ValueError as e:
    raise UserError(f"--resume: {path} is not a JSON file ({e}); run without --resume to start over") from None
  checks = {"args": lambda: ("arguments", prev.get("args"), out["args"]),
            "environment": lambda: ("environment", env.comparable(prev.get("environment", {}), prev.get("device", {})),
                                    env.comparable(out["environment"], out["device"])),
            "files": lambda: ("files", _digests(prev.get("files", {})), _digests(out["files"]))}
  for what, before, now in (checks[k]() for k in keys):
    diff = env.resume_mismatch({what: before}, {what: json.loads(json.dumps(now))})
    if diff:
      raise UserError(f"--resume: {path} was written with other {what} ({diff}); run without --resume to start over")
  return {r["prompt_set"]: r for r in prev.get("results", [])}


def _digests(files):
  if isinstance(files, dict):
    return {k: _digests(v) for k, v in files.items()}
  return [f["sha256"] for f in files or []]


def cmd_eval_dflash(args) -> int:
  from pathlib import Path

  import jax.numpy as jnp

  import dataclasses

  from specjax.bench import env
  from specjax.bench.journal import write_json_atomic
  from specjax.engine.generation import PROMPT_BUCKET, round_up
  from specjax.models.load import load_model
  from specjax.train.dflash import load_spec
  from specjax.train.dflash_eval import evaluate, first_turns, format_eval, plot_eval
  spec = load_spec(args.config, dtype=args.dtype)
  out = {"config": args.config, "spec": dataclasses.asdict(spec), "target": spec.target, "dtype": spec.dtype,
         "args": {k: getattr(args, k) for k in _EVAL_DFLASH_ARGS}, "results": [], "git_revision": env.git_revision(),
         "device": env.device_info(), "environment": env.environment()}
  if args.resume:                        # arguments and environment before the model loads, files after
    _eval_dflash_resume(args.out, out, keys=("args", "environment"))
  target = load_model(spec.target, dtype=jnp.dtype(spec.dtype), progress=not args.quiet)
  head = args.head or spec.export
  methods = {f"dflash n{n}": ("dflash", head, int(n), {}) for n in args.n_max.split(",") if n}
  tree = {"depth": args.tree_depth, "top_k": args.tree_top_k}                    # n_max caps a tree's depth
  for n in filter(None, args.tree.split(",")):
    methods[f"dflash tree{n}"] = ("dflash_tree", head, args.tree_depth, {**tree, "n_nodes": int(n)})
  if args.mtp_head:
    methods["mtp n3"] = ("mtp", args.mtp_head, 3, {})
  if args.eagle3_head:
    methods["eagle3 n5"] = ("eagle3", args.eagle3_head, 5, {})
    for n in filter(None, args.eagle3_tree.split(",")):
      methods[f"eagle3 tree{n}"] = ("eagle3_tree", args.eagle3_head, args.tree_depth, {**tree, "n_nodes": int(n)})
  sets = [(name, int(n) if n else args.n_questions) for name, _, n in (x.partition(":") for x in args.prompts.split(","))]
  widest = max(len(p) for name, n in sets for p in first_turns(target, name, n)[1])
  draft = max(max(n, opts.get("n_nodes", 0)) for _, _, n, opts in methods.values())   # tokens or tree nodes verified
  cap = round_up(round_up(widest, PROMPT_BUCKET) + args.max_new_tokens + draft + 2, 64)
  out["files"] = {"target": env.model_files(target.source),
                  "heads": {label: env.head_files(m[1]) for label, m in methods.items()}}
  earlier = _eval_dflash_resume(args.out, out) if args.resume else {}
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  def save(partial=None):   # after each method's row: a run cut short keeps what it finished
    done = out["results"] + ([partial] if partial else [])
    write_json_atomic(args.out, {**out, "results": done}, default=str)

  temps = tuple(float(x) for x in args.temperatures.split(","))
  for name, n in sets:
    prev = earlier.get(name)
    if prev is not None and {(r["method"], r["temperature"]) for r in prev["rows"]} >= {
        (label, t) for label in ["plain", *methods] for t in temps}:
      out["results"].append(prev)        # complete in the interrupted run
    else:
      out["results"].append(evaluate(target, methods, prompt_set=name, n_questions=n, temperatures=temps,
                                     max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, capacity=cap,
                                     progress=not args.quiet, on_row=save, repeats=args.repeats,
                                     done_rows=None if prev is None else prev["rows"]))
    save()
    plot_eval(out["results"], Path(args.out).with_suffix(".png"),
              title=f"DFlash on {spec.target} ({out['device']['device_kind']})")
  print(format_eval(out["results"]))
  print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")
  return 0


def add_dflash_commands(tsub, common) -> None:
  a = tsub.add_parser("dflash", help="build the data (resumable), train a DFlash drafter, export it")
  common(a)
  a.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the config's)")
  a.add_argument("--batch-size", type=int, default=None, help="rows per step (default: the config's)")
  a.add_argument("--n-sequences", type=int, default=None, help="rows of the main dataset at most (default: the config's)")
  a.add_argument("--data-seconds", type=float, default=None, help="grow the main dataset for about this long")
  a.add_argument("--train-seconds", type=float, default=None, help="fit the training into about this many seconds")
  a.add_argument("--no-data", action="store_true", help="train on the datasets as they are")
  a.add_argument("--out-dir", default=None, help="checkpoints + metrics.jsonl (default: the config's)")
  a.add_argument("--export", default=None, help="where to write the drafter (default: the config's)")
  a.add_argument("--no-resume", action="store_true", help="start over even if checkpoints exist")
  a.set_defaults(func=cmd_dflash)

  e = tsub.add_parser("eval-dflash", help="tau, acceptance by position and tokens/s of a DFlash drafter vs plain")
  common(e)
  e.add_argument("--head", default=None, help="drafter file (default: the config's export)")
  e.add_argument("--prompts", default="mt_bench,humaneval",
                 help="prompt sets (first turns), each optionally with its own count: mt_bench:24,humaneval:16")
  e.add_argument("--n-questions", type=int, default=16, help="first N questions of each (without a count)")
  e.add_argument("--n-max", default="15", help="comma-separated drafts per pass (<= block_size - 1)")
  e.add_argument("--tree", default="", help="comma-separated node budgets (n_nodes) of dflash_tree runs (e.g. 32,64)")
  e.add_argument("--tree-depth", type=int, default=8, help="depth of the trees (dflash_tree, eagle3_tree)")
  e.add_argument("--tree-top-k", type=int, default=8, help="children per expanded node of the trees")
  e.add_argument("--temperatures", default="0,0.7")
  e.add_argument("--max-new-tokens", type=int, default=128)
  e.add_argument("--batch-size", type=int, default=8)
  e.add_argument("--repeats", type=int, default=1, help="time each batch this many times, keep the fastest")
  e.add_argument("--mtp-head", default=None, help="also run this MTP head (n_max 3) side by side")
  e.add_argument("--eagle3-head", default=None, help="also run this EAGLE-3 head (chain, n_max 5) side by side")
  e.add_argument("--eagle3-tree", default="",
                 help="and EAGLE-2 trees of these node budgets (n_nodes) over it (e.g. 32)")
  e.add_argument("--out", required=True, help="result JSON (and a PNG next to it)")
  e.add_argument("--resume", action="store_true",
                 help="continue an interrupted evaluation in --out: temperatures it completed are kept")
  e.set_defaults(func=cmd_eval_dflash)
