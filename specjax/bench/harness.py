"""The benchmark harness: plain decoding and each method on the same prompts, in one process.

Measured as Spec-Bench measures: per prompt (question, turn) the new tokens and wall time of the
generation; per method the speedup is the mean over prompts of (tokens/s of the method) /
(tokens/s of plain decoding on that prompt); `equal` is the fraction of outputs identical to
plain decoding's (meaningful for greedy). Multi-turn questions feed the method's own first answer
back into the chat for the second turn.

One runner (`Runner`) measures for `specjax bench` and `specjax tune` alike:
- compilation is excluded: the first call of every new input shape is an untimed warm-up of
  `WARM_TOKENS` new tokens (the same programs as a full answer: the cache capacity fixes the shapes);
- drafters with cross-request memory (suffix's global tree, ngram_mod's table, ngram_cache's
  dynamic cache) are snapshotted before the warm-up and restored before every timed repeat, so no
  timed run drafts from the answer it is about to produce, and every repeat sees the same drafter;
- each batch runs `repeats` times and its fastest run counts; every repeat's time is kept, and each
  summary gives the spread over repeats (min / median / max of seconds and tokens/s) beside it;
- an optional deadline (tune's wall-time budget) is checked before every generation call.

`run_experiment` journals rows as they complete, rewrites the result file from them (at most every
`RESULT_EVERY_S` seconds, and at the end) and resumes a killed run (`specjax.bench.journal`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from specjax.bench import env
from specjax.bench.config import DEFAULT_CAPACITY, PLAIN_NAME, TINY_RANDOM, ExperimentConfig, MethodConfig, to_dict
from specjax.bench.journal import RowJournal, journal_path, json_ready, write_json_atomic
from specjax.bench.prompts import Question, load_prompt_set
from specjax.engine.decode import generate_plain
from specjax.drafters.base import DraftParams
from specjax.drafters.registry import make_speculator
from specjax.engine.adaptive import AdaptiveConfig
from specjax.engine import speculative_generate
from specjax.errors import UserError
from specjax.engine.generation import PROMPT_BUCKET, round_up
from specjax.models.load import load_model
from specjax.engine.sampling import SamplingParams

PLAIN = PLAIN_NAME
WARM_TOKENS = 2            # new tokens of the untimed warm-up call of a new input shape
RESULT_EVERY_S = 10.0      # a partial result file is rewritten at most this often (the journal: every call)


class Deadline(Exception):
  """The runner's deadline passed before a generation call."""


@dataclasses.dataclass
class PromptRecord:
  method: str
  question_id: str
  category: str
  turn: int
  new_tokens: int
  seconds: float              # this prompt's share of its batch's wall time (fastest repeat / prompts)
  batch_seconds: float = 0.0  # wall time of the whole batch the prompt ran in (fastest repeat)
  repeat_seconds: list = dataclasses.field(default_factory=list)   # its share of every repeat, in order
  rounds: int = 0
  gen_tokens: int = 0
  acc_tokens: int = 0
  emitted: int = 0
  drafted_by_pos: list = dataclasses.field(default_factory=list)    # kept when the batch is this one prompt
  accepted_by_pos: list = dataclasses.field(default_factory=list)
  batch_by_pos: dict | None = None   # {"drafted", "accepted"} of a batch of several (on its first prompt)
  draft_seconds: float = 0.0
  equal_to_plain: bool | None = None
  adaptive: dict | None = None  # adaptive drafting's record of the batch (on the batch's first prompt)
  tokens: list = dataclasses.field(default_factory=list, repr=False)

  @property
  def tokens_per_s(self) -> float:
    return self.new_tokens / max(self.seconds, 1e-9)

  @property
  def key(self) -> tuple[str, int]:
    return (self.question_id, self.turn)

  @classmethod
  def from_row(cls, row: dict) -> "PromptRecord":
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in row.items() if k in names})


class Runner:
  """Runs one method (None: plain decoding) over token prompts: an untimed warm-up of
  `warm_tokens` on every new input shape, then `cfg.repeats` timed runs from the same drafter state;
  raises `Deadline` when time.perf_counter() is past `deadline` before a generation call."""

  def __init__(self, cfg: ExperimentConfig, target, method: MethodConfig | None, draft_model_cache: dict, *,
               warm_tokens: int = WARM_TOKENS, deadline: float | None = None):
    self.cfg, self.target, self.method = cfg, target, method
    self.warm_tokens, self.deadline = warm_tokens, deadline
    self.seen_shapes: set = set()
    self.stop_ids = tuple(target.tokenizer.eos_ids) if target.tokenizer is not None else ()
    self.drafter = None
    self.adaptive = None
    if method is not None:
      dm = None
      if method.draft_model:
        if method.draft_model not in draft_model_cache:
          draft_model_cache[method.draft_model] = load_model(method.draft_model, dtype=jnp.dtype(cfg.dtype))
        dm = draft_model_cache[method.draft_model]
      dp = method.draft_params
      self.draft_params = DraftParams(n_max=dp.n_max, n_min=dp.n_min, p_min=dp.p_min)
      self.drafter = make_speculator(method.speculator, target, draft_model=dm, draft_params=self.draft_params,
                                     options=dict(method.options), policy=method.policy, head=method.head)
      ad = method.adaptive
      self.adaptive = (AdaptiveConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in ad.items()})
                       if isinstance(ad, dict) else (AdaptiveConfig() if ad else None))

  @property
  def keeps_memory(self) -> bool:
    """The drafter carries state from one request to the next (suffix, ngram_mod, ngram_cache)."""
    return self.drafter is not None and self.drafter.cross_request_memory

  def _call(self, prompts, max_new_tokens: int, warm: bool = False):
    if self.deadline is not None and time.perf_counter() > self.deadline:
      raise Deadline()
    b = len(prompts)
    s = self.cfg.sampling
    sampling = SamplingParams.make(b, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=self.cfg.seed)
    kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=self.stop_ids,
              capacity=self.cfg.capacity or DEFAULT_CAPACITY)
    if self.drafter is None:
      return generate_plain(self.target.params, self.target.cfg, prompts, **kw)
    return speculative_generate(self.target.params, self.target.cfg, prompts, self.drafter,
                                draft_params=self.draft_params, warm_widths=warm, adaptive=self.adaptive, **kw)

  def _snapshot(self):
    """Cross-request memory of the drafter, to restore after the warm-up and between repeats:
    otherwise a timed run would draft from the answer it is about to produce."""
    return copy.deepcopy(self.drafter.__dict__) if self.keeps_memory else None

  def _restore(self, snap) -> None:
    if snap is not None:   # object.__setattr__: also for frozen dataclasses (identity, hence jit cache, kept)
      for key, value in copy.deepcopy(snap).items():
        object.__setattr__(self.drafter, key, value)

  def run(self, prompts) -> tuple:
    """(the fastest of `repeats` timed runs, the seconds of every run in order)."""
    shape = (len(prompts), round_up(max(len(p) for p in prompts), PROMPT_BUCKET))
    warm = shape not in self.seen_shapes
    snap = self._snapshot() if (warm or self.cfg.repeats > 1) else None
    if warm:
      self._call(prompts, min(self.cfg.max_new_tokens, self.warm_tokens), warm=True)
      self.seen_shapes.add(shape)
    runs = []
    for _ in range(self.cfg.repeats):
      self._restore(snap)
      runs.append(self._call(prompts, self.cfg.max_new_tokens))
    return min(runs, key=lambda r: r.seconds), [r.seconds for r in runs]

  def replay(self, prompts) -> None:
    """One untimed generation, kept only for what the drafter's cross-request memory learns from it:
    a resumed run replays the rows it kept so that the drafter continues as it would have."""
    self._call(prompts, self.cfg.max_new_tokens)


def _messages(question: Question, answers: list[str], turn: int) -> list[dict]:
  msgs = []
  for t in range(turn + 1):
    msgs.append({"role": "user", "content": question.turns[t]})
    if t < turn:
      msgs.append({"role": "assistant", "content": answers[t]})
  return msgs


def _encode(cfg: ExperimentConfig, tok, msgs: list[dict]) -> list[int]:
  return tok.encode_chat(msgs) if cfg.chat else tok.encode(msgs[-1]["content"])


def _n_turns(cfg: ExperimentConfig, batch: list[Question]) -> int:
  return min(cfg.turns, max(len(q.turns) for q in batch))


def row_order(cfg: ExperimentConfig, questions: list[Question]) -> list[tuple[str, int]]:
  """(question_id, turn) of every row of one method, in the order the harness runs them."""
  keys = []
  for start in range(0, len(questions), cfg.batch_size):
    batch = questions[start: start + cfg.batch_size]
    for turn in range(_n_turns(cfg, batch)):
      keys += [(q.question_id, turn) for q in batch if turn < len(q.turns)]
  return keys


def run_method(cfg: ExperimentConfig, target, method: MethodConfig | None, questions: list[Question],
               draft_model_cache: dict, bar=None, *, done: dict | None = None, on_rows=None,
               warm_tokens: int = WARM_TOKENS, deadline: float | None = None) -> list[PromptRecord]:
  """Every row of one method over `questions`, batch after batch. `done`: {(question_id, turn): record}
  kept from an interrupted run (not run again); `on_rows(records)` after each generation call;
  `deadline`: raise `Deadline` once time.perf_counter() passes it before a generation call."""
  done = done or {}
  todo = set(row_order(cfg, questions)) - set(done)
  if deadline is not None and time.perf_counter() > deadline:
    raise Deadline()
  runner = Runner(cfg, target, method, draft_model_cache, warm_tokens=warm_tokens, deadline=deadline) if todo else None
  records = []
  for start in range(0, len(questions), cfg.batch_size):
    records += run_batch(cfg, target, runner, method, questions[start: start + cfg.batch_size], bar,
                         done=done, todo=todo, on_rows=on_rows)
  return records


def run_batch(cfg: ExperimentConfig, target, runner: Runner | None, method: MethodConfig | None,
              batch: list[Question], bar=None, *, done: dict | None = None, todo: set | None = None,
              on_rows=None) -> list[PromptRecord]:
  """One batch of questions, every turn, with one method's runner. Rows in `done` are taken as they
  are (their answers feed the next turn); a drafter with cross-request memory replays them, untimed,
  while rows of this method remain to run (`todo`, emptied as rows complete)."""
  name = PLAIN if method is None else method.name
  tok = target.tokenizer
  done = done or {}
  todo = set() if todo is None else todo
  records = []
  answers: dict[int, list[str]] = {i: [] for i in range(len(batch))}
  n_turns = _n_turns(cfg, batch)
  for turn in range(n_turns):
    idx = [i for i, q in enumerate(batch) if turn < len(q.turns)]
    prompts = {i: _encode(cfg, tok, _messages(batch[i], answers[i], turn)) for i in idx}
    out = {i: done[(batch[i].question_id, turn)] for i in idx if (batch[i].question_id, turn) in done}
    new = [i for i in idx if i not in out]
    if out and todo and runner is not None and runner.keeps_memory:
      runner.replay([prompts[i] for i in idx if i in out])
    if new:
      r, repeat_seconds = runner.run([prompts[i] for i in new])
      fresh = []
      for j, i in enumerate(new):
        rec = _record(name, batch[i], turn, r, j, len(new), repeat_seconds, method is not None)
        out[i] = rec
        fresh.append(rec)
        todo.discard(rec.key)
      if on_rows is not None:
        on_rows(fresh)
    for i in idx:
      if turn + 1 < n_turns:   # the answer goes into the next turn's chat
        answers[i].append(tok.decode(out[i].tokens))
      records.append(out[i])
    if bar is not None:
      bar.update(len(idx))
  return records


def _record(name: str, q: Question, turn: int, r, j: int, n: int, repeat_seconds: list[float],
            speculative: bool) -> PromptRecord:
  """The row of prompt j of a call of n prompts: an equal share of the call's wall time."""
  tokens = [int(t) for t in r.tokens[j]]
  rec = PromptRecord(method=name, question_id=q.question_id, category=q.category, turn=turn,
                     new_tokens=len(tokens), seconds=r.seconds / n, tokens=tokens, batch_seconds=r.seconds,
                     repeat_seconds=[s / n for s in repeat_seconds])
  if speculative:
    st = r.stats
    rec.rounds, rec.acc_tokens = int(st.per_seq_rounds[j]), int(st.per_seq_acc_tokens[j])
    rec.gen_tokens, rec.emitted = int(st.per_seq_gen_tokens[j]), int(st.per_seq_emitted[j])
    rec.draft_seconds = st.draft_seconds
    rec.adaptive = st.adaptive if j == 0 else None
    if n == 1:   # per-position counts are per batch; kept when the batch is one prompt
      rec.drafted_by_pos, rec.accepted_by_pos = list(st.drafted_by_pos), list(st.accepted_by_pos)
    elif j == 0:
      rec.batch_by_pos = {"drafted": list(st.drafted_by_pos), "accepted": list(st.accepted_by_pos)}
  return rec


def position_counts(records: list[PromptRecord]) -> tuple[np.ndarray, np.ndarray]:
  """(drafted [K], accepted [K]) of one method over every batch of `records`: the counts of
  one-prompt batches and those of larger batches (kept on their first prompt). Whole batches only:
  the counts of a batch cannot be split by prompt (or by category)."""
  counts = [(r.drafted_by_pos, r.accepted_by_pos) for r in records if r.drafted_by_pos]
  counts += [(r.batch_by_pos["drafted"], r.batch_by_pos["accepted"]) for r in records if r.batch_by_pos]
  if not counts:
    return np.zeros(0), np.zeros(0)
  return np.sum([d for d, _ in counts], axis=0), np.sum([a for _, a in counts], axis=0)


def repeat_spread(tokens: int, seconds_by_repeat: list[float]) -> dict | None:
  """min / median / max over repeats of seconds and tokens/s; repeat k totals every batch's k-th
  timed run (the figures used take each batch's fastest run, so they are at least as fast as the
  fastest repeat here)."""
  if not seconds_by_repeat:
    return None
  tps = [tokens / max(x, 1e-9) for x in seconds_by_repeat]
  stats = lambda xs: {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}   # noqa: E731
  return {"n": len(seconds_by_repeat), "seconds": stats(seconds_by_repeat), "tokens_per_s": stats(tps)}


def summarize(records: list[PromptRecord], plain: dict) -> dict:
  """One method's figures over `records`: seconds and tokens/s take each batch's fastest repeat;
  `repeat_spread` gives min / median / max over repeats beside them."""
  speedups = [r.tokens_per_s / plain[(r.question_id, r.turn)].tokens_per_s for r in records
              if (r.question_id, r.turn) in plain]
  equal = [r.equal_to_plain for r in records if r.equal_to_plain is not None]
  rounds = sum(r.rounds for r in records)
  acc = sum(r.acc_tokens for r in records)
  drafted = np.sum([r.drafted_by_pos for r in records if r.drafted_by_pos], axis=0) if any(
      r.drafted_by_pos for r in records) else np.zeros(0)
  accepted = np.sum([r.accepted_by_pos for r in records if r.accepted_by_pos], axis=0) if any(
      r.accepted_by_pos for r in records) else np.zeros(0)
  tokens = sum(r.new_tokens for r in records)
  seconds = sum(r.seconds for r in records)
  return {
      "prompts": len(records),
      "new_tokens": tokens,
      "seconds": seconds,
      "tokens_per_s": tokens / max(seconds, 1e-9),
      "mean_tokens_per_s": statistics.fmean(r.tokens_per_s for r in records) if records else 0.0,
      "speedup": statistics.fmean(speedups) if speedups else None,
      "tau": sum(r.emitted for r in records) / rounds if rounds else 1.0,
      "acceptance_rate": acc / max(sum(r.gen_tokens for r in records), 1) if rounds else None,
      "acceptance_by_pos": [float(a / d) if d else None for a, d in zip(accepted, drafted)],   # None: never drafted
      "equal": statistics.fmean(equal) if equal else None,
      "draft_seconds": sum(r.draft_seconds for r in records),
      "draft_ms_per_round": 1e3 * sum(r.draft_seconds for r in records) / rounds if rounds else None,
      "repeat_spread": _spread(records, tokens),
      **({"adaptive": _adaptive_summary([r.adaptive for r in records if r.adaptive])}
         if any(r.adaptive for r in records) else {}),
  }


def _spread(records: list[PromptRecord], tokens: int) -> dict | None:
  n = {len(r.repeat_seconds) for r in records}
  if len(n) != 1 or not min(n):
    return None
  return repeat_spread(tokens, [sum(r.repeat_seconds[k] for r in records) for k in range(min(n))])


def _adaptive_summary(runs: list[dict]) -> dict:
  """Adaptive drafting over the batches: measured costs (of the last batch), rounds at each width,
  and the first batch's segments in order."""
  rounds: dict[int, int] = {}
  for r in runs:
    for w, n, *_ in r["segments"]:
      rounds[w] = rounds.get(w, 0) + n
  return {"widths": runs[-1]["widths"], "costs_ms": runs[-1]["costs_ms"],
          "measured_ms": runs[-1].get("measured_ms"), "replayed_tau": runs[-1].get("replayed_tau"),
          "rounds_at_width": {str(w): rounds.get(w, 0) for w in runs[-1]["widths"]},
          "first_batch_segments": runs[0]["segments"]}


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
    return api.load(cfg.target, dtype=cfg.dtype, mesh=cfg.mesh)
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


def _digest(tokens: list[int]) -> str:
  """A short checksum of a row's tokens: two results' rows can be compared without the tokens."""
  return hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).hexdigest()[:16]


def compare_with_plain(by_method: dict[str, list[PromptRecord]]) -> dict:
  """Set each record's `equal_to_plain` (its tokens are plain decoding's for the same prompt; None
  where plain decoding did not run it). -> plain decoding's records by (question_id, turn)."""
  plain = {(r.question_id, r.turn): r for r in by_method.get(PLAIN, [])}
  for recs in by_method.values():
    for r in recs:
      ref = plain.get((r.question_id, r.turn))
      r.equal_to_plain = None if ref is None else (r.tokens == ref.tokens)
  return plain


def result_dict(cfg: ExperimentConfig, by_method: dict[str, list[PromptRecord]], wall: float, *,
                files: dict | None = None, complete: bool = True, resumed_rows: int = 0,
                provenance: dict | None = None) -> dict:
  """The result (JSON-ready) of measured records: each record is compared with plain decoding's
  answer to the same prompt, then summarized per method, overall and by category; with the
  provenance of the run (git revision, device, environment, files read)."""
  plain = compare_with_plain(by_method)
  summary = {}
  for name, recs in by_method.items():
    cats = defaultdict(list)
    for r in recs:
      cats[r.category].append(r)
    summary[name] = {"overall": summarize(recs, plain),
                     "by_category": {c: summarize(rs, plain) for c, rs in sorted(cats.items())}}
  p = provenance or {}
  return {
      "experiment": cfg.name,
      "config": to_dict(cfg),
      "git_revision": p.get("git_revision") or env.git_revision(),
      "device": p.get("device") or env.device_info(),
      "environment": p.get("environment") or env.environment(),
      "files": files,
      "complete": complete,
      "resumed_rows": resumed_rows,
      "wall_seconds": wall,
      "summary": summary,
      "prompts": {name: [{**{k: v for k, v in dataclasses.asdict(r).items() if k != "tokens"},
                          "tokens_digest": _digest(r.tokens)} for r in recs]
                  for name, recs in by_method.items()},
  }
