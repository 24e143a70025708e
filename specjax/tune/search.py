"""The search (`run_tune`): plain reference, random search or successive halving under a trials /
seconds budget, the best trial, and plain / default / best on the held-out questions."""

from __future__ import annotations

import dataclasses
import math
import time

from specjax.bench import harness
from specjax.bench.config import MethodConfig, to_dict
from specjax.bench.prompts import Question
from specjax.bench.records import PLAIN, PromptRecord, result_dict, summarize as summarize_records
from specjax.tune.config import TuneConfig, TuneError, _plain, tune_config_to_dict
from specjax.tune.questions import split_questions
from specjax.tune.report import _fmt, _num
from specjax.tune.space import Space, method_key, method_label
from specjax.tune.trial import Deadline, run_questions, summarize


_SUMMARY_KEYS = ("prompts", "new_tokens", "seconds", "tokens_per_s", "mean_tokens_per_s", "speedup", "tau",
                 "acceptance_rate", "equal", "draft_seconds", "repeat_spread")


def _trial_row(index: int, method: MethodConfig) -> dict:
  return {"index": index, "name": method.name, "label": method_label(method),
          "speculator": method.speculator, "chain": "," in method.speculator,
          "method": _plain(to_dict(method)), "status": "pending", "error": None, "rungs": [],
          "n_questions": 0, "metric": None, "wall_seconds": 0.0}


def halving_schedule(n_questions: int, trials: int, eta: int, min_questions: int = 1) -> list[int]:
  """Questions per rung of successive halving: the last rung uses all `n_questions`, each earlier
  one 1/eta of the next (never below `min_questions`), and there are no more rungs than halving
  `trials` candidates down to one needs (1 + log_eta(trials))."""
  rungs = [n_questions]
  max_rungs = 1 + int(math.log(max(trials, 1), eta) + 1e-9)
  while rungs[0] // eta >= max(min_questions, 1) and len(rungs) < max_rungs:
    rungs.insert(0, rungs[0] // eta)
  return rungs


def run_tune(tcfg: TuneConfig, *, target=None, questions: list[Question] | None = None, progress: bool = True,
             log=None) -> dict:
  """Search, then evaluate plain / default / best on the held-out questions. Returns the report dict
  (JSON-ready; `write_outputs` writes it). `target`: a loaded model to reuse (else `cfg.target` is
  loaded); `questions`: instead of the config's prompt sets."""
  from tqdm.auto import tqdm

  from specjax.bench import env

  cfg, t = tcfg.experiment, tcfg.tune
  say = log or (lambda s: None)
  t_start = time.perf_counter()
  if questions is None:                            # prompt sets first: a bad one fails before the model loads
    questions = harness.load_questions(cfg)
  tune_qs, holdout_qs = split_questions(list(questions), t.holdout_fraction, t.seed)
  if target is None:
    target = harness.load_target(cfg, progress=progress)
  say(f"{len(tune_qs)} tuning and {len(holdout_qs)} held-out questions")
  draft_cache: dict = {}
  default = dataclasses.replace(tcfg.default_method)

  t0 = time.perf_counter()
  deadline = None if t.budget.seconds is None else t0 + t.budget.seconds
  n_trials = t.budget.trials
  seen: set[str] = set()
  trials: list[dict] = []
  methods: list[MethodConfig] = []
  records: dict[int, list[PromptRecord]] = {}
  stop_reason = None

  # plain decoding on the tuning questions: speedup reference (and the plot's baseline)
  plain_records: list[PromptRecord] = []
  try:
    plain_records = run_questions(cfg, target, None, tune_qs, draft_cache, deadline)
  except Deadline:
    stop_reason = "seconds"
  plain = {(r.question_id, r.turn): r for r in plain_records}
  plain_summary = summarize_records(plain_records, plain) if plain_records else None

  space = Space(t)

  def new_candidates(n):
    out = []
    if t.include_default and not methods and (n is None or n > 0):
      out.append(dataclasses.replace(default, name="trial0"))
      seen.add(method_key(default))
      n = None if n is None else n - 1
    if n is None or n > 0:
      out += list(space.candidates(n, seen))
    for m in out:
      methods.append(m)
      trials.append(_trial_row(len(trials), m))
    return out

  def evaluate(i: int, qs: list[Question]) -> bool:
    """Run trial i on questions it has not run yet; False when the deadline cut it."""
    row = trials[i]
    done_ids = {(r.question_id, r.turn) for r in records.get(i, [])}
    todo = [q for q in qs if (q.question_id, 0) not in done_ids]
    t1 = time.perf_counter()
    try:
      recs = run_questions(cfg, target, methods[i], todo, draft_cache, deadline) if todo else []
    except Deadline:
      row["wall_seconds"] += time.perf_counter() - t1
      if row["status"] == "pending":
        row["status"] = "cut"
      return False
    except Exception as e:  # noqa: BLE001 - a bad candidate is a result of the search, not a crash
      row.update(status="error", error=f"{type(e).__name__}: {e}")
      row["wall_seconds"] += time.perf_counter() - t1
      say(f"trial {i} failed: {row['error']}")
      return True
    row["wall_seconds"] += time.perf_counter() - t1
    records[i] = records.get(i, []) + recs
    s = summarize(records[i], plain)
    rung = {"n_questions": len(qs), **{k: s[k] for k in _SUMMARY_KEYS}, "elapsed": time.perf_counter() - t0}
    row["rungs"].append(rung)
    row.update({k: s[k] for k in _SUMMARY_KEYS}, status="ok", n_questions=len(qs), metric=s[t.metric])
    say(f"trial {i} [{len(qs)} q] {row['label']}: {t.metric} {_fmt(row['metric'])}")
    return True

  bar = tqdm(desc=f"tune {cfg.name}", unit="trial", total=n_trials, disable=not progress)
  if stop_reason is None and t.strategy == "random":
    i = 0
    while n_trials is None or i < n_trials:
      if deadline is not None and time.perf_counter() > deadline:
        stop_reason = "seconds"
        break
      if not new_candidates(1):
        stop_reason = "space exhausted"
        break
      ok = evaluate(i, tune_qs)
      bar.update(1)
      i += 1
      if not ok:
        stop_reason = "seconds"
        break
    else:
      stop_reason = "trials"
    rung_sizes = [len(tune_qs)]
  elif stop_reason is None:
    rung_sizes = halving_schedule(len(tune_qs), n_trials, t.eta, t.min_questions)
    alive = list(range(len(new_candidates(n_trials))))
    if len(alive) < n_trials:
      say(f"the space holds only {len(alive)} distinct candidates")
    for r_i, n_q in enumerate(rung_sizes):
      qs = tune_qs[:n_q]
      for i in alive:
        if not evaluate(i, qs):
          stop_reason = "seconds"
          break
        if r_i == 0:
          bar.update(1)
      if stop_reason:
        break
      ok = [i for i in alive if trials[i]["status"] == "ok"]
      if r_i + 1 < len(rung_sizes):
        keep = max(1, math.ceil(len(ok) / t.eta))
        alive = sorted(ok, key=lambda i: (-_num(trials[i]["metric"]), i))[:keep]
    else:
      stop_reason = "trials"
  bar.close()
  search_seconds = time.perf_counter() - t0

  best = best_trial(trials)
  if best is None:
    raise TuneError(f"no trial finished within the budget ({t.budget}); raise it")
  best_method = dataclasses.replace(methods[best], name=_tuned_name(default))
  say(f"best: trial {best} {trials[best]['label']} ({t.metric} {_fmt(trials[best]['metric'])})")

  # held-out: plain, default, tuned on questions the search never saw (no deadline here)
  t2 = time.perf_counter()
  by_method = {PLAIN: run_questions(cfg, target, None, holdout_qs, draft_cache)}
  by_method[default.name] = run_questions(cfg, target, default, holdout_qs, draft_cache)
  by_method[best_method.name] = run_questions(cfg, target, best_method, holdout_qs, draft_cache)
  holdout_cfg = dataclasses.replace(cfg, name=f"{cfg.name}_holdout", methods=(default, best_method))
  holdout = result_dict(holdout_cfg, by_method, time.perf_counter() - t2, files=harness.run_files(holdout_cfg, target))
  hs = holdout["summary"]
  say(f"held-out tokens/s: plain {_fmt(hs['plain']['overall']['tokens_per_s'])}, "
      f"{default.name} {_fmt(hs[default.name]['overall']['tokens_per_s'])}, "
      f"{best_method.name} {_fmt(hs[best_method.name]['overall']['tokens_per_s'])}")

  return {
      "experiment": cfg.name,
      "config": tune_config_to_dict(tcfg),
      "git_revision": env.git_revision(),
      "device": env.device_info(),
      "environment": env.environment(),
      "files": _files(cfg, target, methods),
      "strategy": t.strategy,
      "metric": t.metric,
      "seed": t.seed,
      "budget": _plain(dataclasses.asdict(t.budget)),
      "stop_reason": stop_reason,
      "rungs": rung_sizes,
      "search_seconds": search_seconds,
      "wall_seconds": time.perf_counter() - t_start,
      "tune_questions": [q.question_id for q in tune_qs],
      "holdout_questions": [q.question_id for q in holdout_qs],
      "plain": plain_summary,
      "default": {"name": default.name, "label": method_label(default), "method": _plain(to_dict(default))},
      "trials": trials,
      "best": best,
      "best_method": _plain(to_dict(best_method)),
      "holdout": holdout,
      "_questions": (tune_qs, holdout_qs),           # dropped by write_outputs (not JSON)
  }


def _files(cfg, target, methods: list[MethodConfig]) -> dict:
  """The files the search read: the target's, and those of every draft model and head tried."""
  return harness.run_files(dataclasses.replace(cfg, methods=tuple(methods)), target)


def _tuned_name(default: MethodConfig) -> str:
  return "tuned" if default.name != "tuned" else "tuned_best"


def best_trial(trials: list[dict]) -> int | None:
  """Index of the trial with the highest metric among the finished ones evaluated on the most
  questions (earlier trial on ties); None when none finished."""
  ok = [r for r in trials if r["rungs"] and r["metric"] is not None]
  if not ok:
    return None
  most = max(r["rungs"][-1]["n_questions"] for r in ok)
  top = [r for r in ok if r["rungs"][-1]["n_questions"] == most]
  return max(top, key=lambda r: (r["metric"], -r["index"]))["index"]
