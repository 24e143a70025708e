"""One method (or plain decoding) over the prompts of an experiment, batch by batch: the one
runner behind `specjax bench` and `specjax tune`.

- compilation is excluded: the first call of every new input shape is an untimed warm-up of
  `WARM_TOKENS` new tokens (the same programs as a full answer: the cache capacity fixes the shapes);
- drafters with cross-request memory (suffix's global tree, ngram_mod's table, ngram_cache's
  dynamic cache) are snapshotted before the warm-up and restored before every timed repeat, so no
  timed run drafts from the answer it is about to produce, and every repeat sees the same drafter;
- each batch runs `repeats` times and its fastest run counts; every repeat's time is kept
  (`specjax.bench.records.repeat_spread` gives the spread beside the figures);
- an optional deadline (tune's wall-time budget) is checked before every generation call.

Multi-turn questions feed the method's own first answer back into the chat for the second turn.
Each prompt becomes a `PromptRecord` (`specjax.bench.records`).
"""

from __future__ import annotations

import copy
import time

import jax.numpy as jnp

from specjax.bench.config import DEFAULT_CAPACITY, ExperimentConfig, MethodConfig
from specjax.bench.prompts import Question
from specjax.bench.records import PLAIN, PromptRecord
from specjax.bench.timing import heap_frozen
from specjax.drafters.base import DraftParams
from specjax.drafters.registry import make_speculator
from specjax.engine import speculative_generate
from specjax.engine.adaptive import AdaptiveConfig
from specjax.engine.decode import generate_plain
from specjax.engine.generation import PROMPT_BUCKET, round_up
from specjax.engine.sampling import SamplingParams
from specjax.models.load import load_model

WARM_TOKENS = 2            # new tokens of the untimed warm-up call of a new input shape


class Deadline(Exception):
  """The runner's deadline passed before a generation call."""


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
      runs.append(self._timed_call(prompts))
    return min(runs, key=lambda r: r.seconds), [r.seconds for r in runs]

  def _timed_call(self, prompts):
    with heap_frozen():     # plain and speculative calls alike: no heap-sized collection lands in one
      return self._call(prompts, self.cfg.max_new_tokens)

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
