"""The search (`run_tune`): plain reference, random search or successive halving under a trials /
seconds budget, the best trial, and plain / default / best on the held-out questions. A `Search`
holds one search's state (candidates, trial rows, records, deadline); `run_tune` runs its steps."""

from __future__ import annotations

import dataclasses
import math
import time

from specjax.bench import harness
from specjax.bench.config import ExperimentConfig, MethodConfig, to_dict
from specjax.bench.prompts import Question
from specjax.bench.records import PLAIN, PromptRecord, result_dict, summarize as summarize_records
from specjax.tune.config import TuneConfig, TuneError, TuneSettings, _plain, tune_config_to_dict
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
  cfg, t = tcfg.experiment, tcfg.tune
  say = log or (lambda s: None)
  t_start = time.perf_counter()
  if questions is None:                            # prompt sets first: a bad one fails before the model loads
    questions = harness.load_questions(cfg)
  tune_qs, holdout_qs = split_questions(list(questions), t.holdout_fraction, t.seed)
  if target is None:
    target = harness.load_target(cfg, progress=progress)
  say(f"{len(tune_qs)} tuning and {len(holdout_qs)} held-out questions")
  search = Search(cfg, t, target, dataclasses.replace(tcfg.default_method), say)
  stop_reason, rung_sizes = search.run(tune_qs, progress)
  search_seconds = time.perf_counter() - search.t0
  best = best_trial(search.trials)
  if best is None:
    raise TuneError(f"no trial finished within the budget ({t.budget}); raise it")
  best_method = dataclasses.replace(search.methods[best], name=_tuned_name(search.default))
  say(f"best: trial {best} {search.trials[best]['label']} ({t.metric} {_fmt(search.trials[best]['metric'])})")
  holdout = _holdout(cfg, target, search.default, best_method, holdout_qs, search.draft_cache, say)
  return _report(tcfg, search, target, tune_qs, holdout_qs, stop_reason=stop_reason, rung_sizes=rung_sizes,
                 search_seconds=search_seconds, wall_seconds=time.perf_counter() - t_start, best=best,
                 best_method=best_method, holdout=holdout)


class Search:
  """One search's state: plain decoding's records on the tuning questions (the speedup reference),
  the candidates drawn so far, their trial rows and records, and the wall-time deadline."""

  def __init__(self, cfg: ExperimentConfig, t: TuneSettings, target, default: MethodConfig, say):
    self.cfg, self.t, self.target, self.default, self.say = cfg, t, target, default, say
    self.draft_cache: dict = {}
    self.t0 = time.perf_counter()
    self.deadline = None if t.budget.seconds is None else self.t0 + t.budget.seconds
    self.space = Space(t)
    self.seen: set[str] = set()
    self.trials: list[dict] = []
    self.methods: list[MethodConfig] = []
    self.records: dict[int, list[PromptRecord]] = {}
    self.plain_records: list[PromptRecord] = []
    self.plain: dict = {}

  @property
  def plain_summary(self) -> dict | None:
    return summarize_records(self.plain_records, self.plain) if self.plain_records else None

  def run(self, tune_qs: list[Question], progress: bool) -> tuple[str, list[int]]:
    """Plain decoding, then the strategy's trials on `tune_qs`. -> (why it stopped, questions per rung)."""
    from tqdm.auto import tqdm
    try:
      self.plain_records = run_questions(self.cfg, self.target, None, tune_qs, self.draft_cache, self.deadline)
    except Deadline:
      return "seconds", []
    self.plain = {(r.question_id, r.turn): r for r in self.plain_records}
    bar = tqdm(desc=f"tune {self.cfg.name}", unit="trial", total=self.t.budget.trials, disable=not progress)
    try:
      return self.run_random(tune_qs, bar) if self.t.strategy == "random" else self.run_halving(tune_qs, bar)
    finally:
      bar.close()

  def new_candidates(self, n: int | None) -> list[MethodConfig]:
    """Up to n (None: without end) new distinct candidates, the default first; each gets a trial row."""
    out = []
    if self.t.include_default and not self.methods and (n is None or n > 0):
      out.append(dataclasses.replace(self.default, name="trial0"))
      self.seen.add(method_key(self.default))
      n = None if n is None else n - 1
    if n is None or n > 0:
      out += list(self.space.candidates(n, self.seen))
    for m in out:
      self.methods.append(m)
      self.trials.append(_trial_row(len(self.trials), m))
    return out

  def evaluate(self, i: int, qs: list[Question]) -> bool:
    """Run trial i on the questions of `qs` it has not run yet and update its row; False when the
    deadline cut it (a failing candidate is a result of the search: its row says why)."""
    row = self.trials[i]
    done_ids = {(r.question_id, r.turn) for r in self.records.get(i, [])}
    todo = [q for q in qs if (q.question_id, 0) not in done_ids]
    t1 = time.perf_counter()
    try:
      recs = (run_questions(self.cfg, self.target, self.methods[i], todo, self.draft_cache, self.deadline)
              if todo else [])
    except Deadline:
      row["wall_seconds"] += time.perf_counter() - t1
      if row["status"] == "pending":
        row["status"] = "cut"
      return False
    except Exception as e:  # noqa: BLE001 - a bad candidate is a result of the search, not a crash
      row.update(status="error", error=f"{type(e).__name__}: {e}")
      row["wall_seconds"] += time.perf_counter() - t1
      self.say(f"trial {i} failed: {row['error']}")
      return True
    row["wall_seconds"] += time.perf_counter() - t1
    self.records[i] = self.records.get(i, []) + recs
    s = summarize(self.records[i], self.plain)
    rung = {"n_questions": len(qs), **{k: s[k] for k in _SUMMARY_KEYS}, "elapsed": time.perf_counter() - self.t0}
    row["rungs"].append(rung)
    row.update({k: s[k] for k in _SUMMARY_KEYS}, status="ok", n_questions=len(qs), metric=s[self.t.metric])
    self.say(f"trial {i} [{len(qs)} q] {row['label']}: {self.t.metric} {_fmt(row['metric'])}")
    return True

  def run_random(self, tune_qs: list[Question], bar) -> tuple[str, list[int]]:
    """Random search: one candidate after another on every tuning question, until the trials or
    the seconds run out (or the space)."""
    n_trials, i = self.t.budget.trials, 0
    while n_trials is None or i < n_trials:
      if self.deadline is not None and time.perf_counter() > self.deadline:
        return "seconds", [len(tune_qs)]
      if not self.new_candidates(1):
        return "space exhausted", [len(tune_qs)]
      ok = self.evaluate(i, tune_qs)
      bar.update(1)
      i += 1
      if not ok:
        return "seconds", [len(tune_qs)]
    return "trials", [len(tune_qs)]

  def run_halving(self, tune_qs: list[Question], bar) -> tuple[str, list[int]]:
    """Successive halving: every candidate on the first rung's questions, the best 1/eta of those
    that finished on eta times as many, ..., the last rung on every tuning question."""
    t = self.t
    rung_sizes = halving_schedule(len(tune_qs), t.budget.trials, t.eta, t.min_questions)
    alive = list(range(len(self.new_candidates(t.budget.trials))))
    if len(alive) < t.budget.trials:
      self.say(f"the space holds only {len(alive)} distinct candidates")
    for r_i, n_q in enumerate(rung_sizes):
      for i in alive:
        if not self.evaluate(i, tune_qs[:n_q]):
          return "seconds", rung_sizes
        if r_i == 0:
          bar.update(1)
      ok = [i for i in alive if self.trials[i]["status"] == "ok"]
      if r_i + 1 < len(rung_sizes):
        keep = max(1, math.ceil(len(ok) / t.eta))
        alive = sorted(ok, key=lambda i: (-_num(self.trials[i]["metric"]), i))[:keep]
    return "trials", rung_sizes


def _holdout(cfg: ExperimentConfig, target, default: MethodConfig, best_method: MethodConfig,
             holdout_qs: list[Question], draft_cache: dict, say) -> dict:
  """Plain, default and tuned on the questions the search never saw (no deadline here): a harness
  result."""
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
  return holdout


def _report(tcfg: TuneConfig, search: "Search", target, tune_qs, holdout_qs, *, stop_reason, rung_sizes,
            search_seconds, wall_seconds, best, best_method, holdout) -> dict:
  """The report of a search (JSON-ready but for `_questions`, which `write_outputs` drops)."""
  from specjax.bench import env
  cfg, t, default = tcfg.experiment, tcfg.tune, search.default
  return {
      "experiment": cfg.name,
      "config": tune_config_to_dict(tcfg),
      "git_revision": env.git_revision(),
      "device": env.device_info(),
      "environment": env.environment(),
      "files": _files(cfg, target, search.methods),
      "strategy": t.strategy,
      "metric": t.metric,
      "seed": t.seed,
      "budget": _plain(dataclasses.asdict(t.budget)),
      "stop_reason": stop_reason,
      "rungs": rung_sizes,
      "search_seconds": search_seconds,
      "wall_seconds": wall_seconds,
      "tune_questions": [q.question_id for q in tune_qs],
      "holdout_questions": [q.question_id for q in holdout_qs],
      "plain": search.plain_summary,
      "default": {"name": default.name, "label": method_label(default), "method": _plain(to_dict(default))},
      "trials": search.trials,
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
