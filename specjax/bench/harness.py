"""The benchmark harness: plain decoding and each method of a config on the same prompts, in one
process (`specjax bench`).

Every method runs through `specjax.bench.runner` (an untimed warm-up per input shape, the fastest
of `repeats` timed runs, drafters' cross-request memory restored between repeats); its rows are
`specjax.bench.records.PromptRecord`s, summarised and written by `records.result_dict`.

`run_experiment` journals rows as they complete, rewrites the result file from them (at most every
`RESULT_EVERY_S` seconds, and at the end) and resumes a killed run (`specjax.bench.journal`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp
from tqdm.auto import tqdm

from specjax.bench import env
from specjax.bench.config import TINY_RANDOM, ExperimentConfig, to_dict
from specjax.bench.journal import RowJournal, journal_path, json_ready, write_json_atomic
from specjax.bench.prompts import Question, load_prompt_set
from specjax.bench.records import PLAIN, PromptRecord, result_dict
from specjax.bench.runner import Runner, row_order, run_batch, run_method
from specjax.errors import UserError
from specjax.models.load import load_model

RESULT_EVERY_S = 10.0      # a partial result file is rewritten at most this often (the journal: every call)


def load_questions(cfg: ExperimentConfig) -> list[Question]:
  """The questions of the config's prompt sets (read before any model is loaded)."""
  questions = []
  for ps in cfg.prompts:
    questions += load_prompt_set(ps, limit=cfg.limit, categories=list(cfg.categories) or None)
  if not questions:
    raise UserError(f"prompts: no questions in {list(cfg.prompts)}"
                    + (f" of categories {list(cfg.categories)}" if cfg.categories else ""))
  return questions


def load_target(cfg: ExperimentConfig, progress: bool = True):
  """The config's target: a fetch name or path, or `tiny-random` (a tiny random model for tests)."""
  if cfg.target == TINY_RANDOM:
    from specjax.tune.tiny_model import tiny_target
    return tiny_target()
  if getattr(cfg, "mesh", None):   # sharded over devices: read on the host, written to its shards
    from specjax import api
    return api.load(cfg.target, dtype=cfg.dtype, mesh=cfg.mesh, head_placement=cfg.head_placement)
  return load_model(cfg.target, dtype=jnp.dtype(cfg.dtype), progress=progress)


def _model_source(name: str) -> str | None:
  from specjax.io.fetch import MODELS, model_path
  path = model_path(name) if name in MODELS else Path(name).expanduser()
  return str(path) if path.exists() else None


def run_files(cfg: ExperimentConfig, target) -> dict:
  """Path, size and sha256 of the files a run reads: the target's, draft models', heads'."""
  files: dict = {"target": [] if cfg.target == TINY_RANDOM else env.model_files(target.source)}
  draft_models = sorted({m.draft_model for m in cfg.methods if m.draft_model})
  if draft_models:
    files["draft_models"] = {d: env.model_files(_model_source(d)) for d in draft_models}
  heads = {m.name: env.head_files(m.head) for m in cfg.methods if m.head}
  if heads:
    files["heads"] = heads
  return files


def _digests(files: dict):
  """The checksums of `run_files`, nested as it is (what a resumed run must match)."""
  if isinstance(files, dict):
    return {k: _digests(v) for k, v in files.items()}
  return [f["sha256"] for f in files]


def _row(rec: PromptRecord) -> dict:
  return dataclasses.asdict(rec)


def _resume_from(cfg: ExperimentConfig, out: Path, journal: RowJournal, now: dict):
  """What a resumed run starts from: None (nothing on disk: a fresh run), a complete result of
  this config (nothing to do), or (header, rows) of the interrupted run, after checking that it ran
  this config in this environment."""
  if not journal.exists():
    if not out.exists():
      print(f"--resume: no partial run at {out}; starting it", file=sys.stderr)
      return None
    try:
      prev = json.loads(out.read_text())
    except ValueError:
      prev = {}
    if prev.get("complete") is True and json_ready(prev.get("config")) == now["config"]:
      return prev
    raise UserError(f"--resume: {out} has no rows journal {journal.path.name} to continue from "
                    "(a run of another config, or of a version without one); run without --resume to start over")
  try:
    header, rows = journal.read()
  except (OSError, ValueError) as e:
    raise UserError(f"--resume: cannot read {journal.path}: {e}") from None
  diff = env.resume_mismatch({"config": header.get("config")}, {"config": now["config"]})
  if diff:
    raise UserError(f"--resume: the config changed since the interrupted run ({diff}); "
                    "run without --resume to start over")
  diff = env.resume_mismatch(env.comparable(header.get("environment", {}), header.get("device", {})),
                             env.comparable(now["environment"], now["device"]))
  if diff:
    raise UserError(f"--resume: the interrupted run measured in another environment ({diff}); "
                    "run without --resume to start over")
  return header, rows


def run_experiment(cfg: ExperimentConfig, progress: bool = True, *, out: str | Path | None = None,
                   resume: bool = False) -> dict:
  """Run plain decoding and every method of `cfg`; return the result dict (JSON-ready).

  With `out` (the result JSON's path) the result is written there after every generation call, and
  the rows with their tokens are journaled beside it (`specjax.bench.journal`); `resume` continues
  an interrupted run from its journal, running only the rows it lacks."""
  questions = load_questions(cfg)
  order = row_order(cfg, questions)
  names = [PLAIN] + [m.name for m in cfg.methods]
  now = {"config": json_ready(to_dict(cfg)), "environment": env.environment(), "device": env.device_info(),
         "git_revision": env.git_revision()}
  out = None if out is None else Path(out)
  journal = None if out is None else RowJournal(journal_path(out))
  earlier = _resume_from(cfg, out, journal, now) if resume and out is not None else None
  if isinstance(earlier, dict):
    return earlier
  target = load_target(cfg, progress)
  files = run_files(cfg, target)
  rows: dict[str, dict] = {n: {} for n in names}
  if earlier is not None:
    header, kept = earlier
    diff = env.resume_mismatch({"files": _digests(header.get("files", {}))}, {"files": _digests(files)})
    if diff:
      raise UserError(f"--resume: the interrupted run read other files ({diff}); run without --resume to start over")
    keys = set(order)
    for row in kept:
      rec = PromptRecord.from_row(row)
      if rec.method in rows and rec.key in keys:
        rows[rec.method][rec.key] = rec
  n_kept = sum(len(r) for r in rows.values())
  if journal is not None:
    journal.start({**now, "files": files}, [_row(r) for n in names for r in rows[n].values()])

  t0 = time.perf_counter()
  last_write = [-float("inf")]

  def write(complete: bool) -> dict:
    by_method = {n: [rows[n][k] for k in order if k in rows[n]] for n in names}
    result = result_dict(cfg, by_method, time.perf_counter() - t0, files=run_files(cfg, target), complete=complete,
                         resumed_rows=n_kept, provenance=now)
    if out is not None:
      write_json_atomic(out, result)
      last_write[0] = time.perf_counter()
    return result

  def on_rows(recs: list[PromptRecord]) -> None:
    for r in recs:
      rows[r.method][r.key] = r
    if journal is not None:
      journal.append([_row(r) for r in recs])
      if time.perf_counter() - last_write[0] >= RESULT_EVERY_S:   # the result of 800 rows takes ~0.3 s to write
        write(complete=False)

  draft_cache: dict = {}
  methods = [None] + list(cfg.methods)
  bar = tqdm(total=len(order) * len(methods), desc=f"bench {cfg.name}", unit="prompt", disable=not progress)
  done = {n: dict(rows[n]) for n in names}
  if cfg.interleave:   # batch by batch, every method in turn
    todo = {n: set(order) - set(done[n]) for n in names}
    runners = [(m, n, Runner(cfg, target, m, draft_cache) if todo[n] else None) for m, n in zip(methods, names)]
    for start in range(0, len(questions), cfg.batch_size):
      batch = questions[start: start + cfg.batch_size]
      for m, n, runner in runners:
        run_batch(cfg, target, runner, m, batch, bar, done=done[n], todo=todo[n], on_rows=on_rows)
  else:
    for m, n in zip(methods, names):
      bar.set_postfix_str(n)
      run_method(cfg, target, m, questions, draft_cache, bar, done=done[n], on_rows=on_rows)
  bar.close()
  result = write(complete=True)
  if journal is not None:
    journal.remove()
  return result
