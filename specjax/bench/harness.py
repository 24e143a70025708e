"""The benchmark harness: plain decoding and each method on the same prompts, in one process.

Measured as Spec-Bench measures: per prompt (question, turn) the new tokens and wall time of the
generation; per method the speedup is the mean over prompts of (tokens/s of the method) /
(tokens/s of plain decoding on that prompt); `equal` is the fraction of outputs identical to
plain decoding's (meaningful for greedy). Compilation is excluded: the first call of every new
input shape is a warm-up and is not timed. Multi-turn questions feed the method's own first
answer back into the chat for the second turn.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections import defaultdict

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from specjax.bench.config import ExperimentConfig, MethodConfig, to_dict
from specjax.bench.env import device_info, git_revision
from specjax.bench.prompts import Question, load_prompt_set
from specjax.decode import generate_plain
from specjax.drafters.base import DraftParams
from specjax.drafters.registry import make_speculator
from specjax.adaptive import AdaptiveConfig
from specjax.engine import speculative_generate
from specjax.generation import PROMPT_BUCKET, round_up
from specjax.models.load import load_model
from specjax.sampling import SamplingParams

PLAIN = "plain"
DEFAULT_CAPACITY = 2048   # one cache size for the whole run: decode loops compile once


@dataclasses.dataclass
class PromptRecord:
  method: str
  question_id: str
  category: str
  turn: int
  new_tokens: int
  seconds: float              # this prompt's share of its batch's wall time (batch time / prompts)
  batch_seconds: float = 0.0  # wall time of the whole batch the prompt ran in
  rounds: int = 0
  gen_tokens: int = 0
  acc_tokens: int = 0
  emitted: int = 0
  drafted_by_pos: list = dataclasses.field(default_factory=list)
  accepted_by_pos: list = dataclasses.field(default_factory=list)
  draft_seconds: float = 0.0
  equal_to_plain: bool | None = None
  adaptive: dict | None = None  # adaptive drafting's record of the batch (on the batch's first prompt)
  tokens: list = dataclasses.field(default_factory=list, repr=False)

  @property
  def tokens_per_s(self) -> float:
    return self.new_tokens / max(self.seconds, 1e-9)


class _Runner:
  """Runs one method over token prompts; warms up (untimed) on every new input shape."""

  def __init__(self, cfg: ExperimentConfig, target, method: MethodConfig | None, draft_model_cache: dict):
    self.cfg, self.target, self.method = cfg, target, method
    self.seen_shapes: set = set()
    self.stop_ids = tuple(target.tokenizer.eos_ids) if target.tokenizer is not None else ()
    self.drafter = None
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

  def _call(self, prompts, warm=False):
    b = len(prompts)
    s = self.cfg.sampling
    sampling = SamplingParams.make(b, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=self.cfg.seed)
    kw = dict(max_new_tokens=self.cfg.max_new_tokens, sampling=sampling, stop_ids=self.stop_ids,
              capacity=self.cfg.capacity or DEFAULT_CAPACITY)
    if self.drafter is None:
      return generate_plain(self.target.params, self.target.cfg, prompts, **kw)
    return speculative_generate(self.target.params, self.target.cfg, prompts, self.drafter,
                                draft_params=self.draft_params, warm_widths=warm, adaptive=self.adaptive, **kw)

  def _snapshot(self):
    """Cross-request memory of the drafter (suffix global tree, ngram_mod table, ...), to restore
    after the warm-up and between repeats: otherwise the timed run would draft from the answer it
    is about to produce."""
    if self.drafter is None or not getattr(self.drafter, "cross_request_memory", False):
      return None
    return copy.deepcopy(self.drafter.__dict__)

  def _restore(self, snap) -> None:
    if snap is not None:   # object.__setattr__: also for frozen dataclasses (identity, hence jit cache, kept)
      for key, value in copy.deepcopy(snap).items():
        object.__setattr__(self.drafter, key, value)

  def run(self, prompts):
    shape = (len(prompts), round_up(max(len(p) for p in prompts), PROMPT_BUCKET))
    snap = self._snapshot()
    if shape not in self.seen_shapes:
      full = self.cfg   # a 2-token warm-up compiles the same programs (capacity fixes every shape)
      self.cfg = dataclasses.replace(full, max_new_tokens=min(full.max_new_tokens, 2))
      try:
        self._call(prompts, warm=True)
      finally:
        self.cfg = full
      self.seen_shapes.add(shape)
    runs = []
    for _ in range(self.cfg.repeats):
      self._restore(snap)
      runs.append(self._call(prompts))
    return min(runs, key=lambda r: r.seconds)


def _messages(question: Question, answers: list[str], turn: int) -> list[dict]:
  msgs = []
  for t in range(turn + 1):
    msgs.append({"role": "user", "content": question.turns[t]})
    if t < turn:
      msgs.append({"role": "assistant", "content": answers[t]})
  return msgs


def run_method(cfg: ExperimentConfig, target, method: MethodConfig | None, questions: list[Question],
               draft_model_cache: dict, bar=None) -> list[PromptRecord]:
  runner = _Runner(cfg, target, method, draft_model_cache)
  records = []
  for start in range(0, len(questions), cfg.batch_size):
    records += run_batch(cfg, target, runner, method, questions[start: start + cfg.batch_size], bar)
  return records


def run_batch(cfg: ExperimentConfig, target, runner: "_Runner", method: MethodConfig | None, batch: list[Question],
              bar=None) -> list[PromptRecord]:
  """One batch of questions, every turn, with one method's runner."""
  name = PLAIN if method is None else method.name
  tok = target.tokenizer
  records = []
  answers: dict[int, list[str]] = {i: [] for i in range(len(batch))}
  n_turns = min(cfg.turns, max(len(q.turns) for q in batch))
  for turn in range(n_turns):
    idx = [i for i, q in enumerate(batch) if turn < len(q.turns)]
    prompts = []
    for i in idx:
      msgs = _messages(batch[i], answers[i], turn)
      prompts.append(tok.encode_chat(msgs) if cfg.chat else tok.encode(msgs[-1]["content"]))
    r = runner.run(prompts)
    share = r.seconds / len(idx)   # each prompt of a batch gets an equal share of its wall time
    for j, i in enumerate(idx):
      q = batch[i]
      answers[i].append(tok.decode(r.tokens[j]))
      rec = PromptRecord(method=name, question_id=q.question_id, category=q.category, turn=turn,
                         new_tokens=len(r.tokens[j]), seconds=share, tokens=r.tokens[j],
                         batch_seconds=r.seconds)
      if method is not None:
        st = r.stats
        rec.rounds, rec.acc_tokens = st.per_seq_rounds[j], st.per_seq_acc_tokens[j]
        rec.gen_tokens, rec.emitted = st.per_seq_gen_tokens[j], st.per_seq_emitted[j]
        rec.draft_seconds = st.draft_seconds
        rec.adaptive = st.adaptive if j == 0 else None
        if len(idx) == 1:   # per-position counts are per batch; kept when the batch is one prompt
          rec.drafted_by_pos, rec.accepted_by_pos = st.drafted_by_pos, st.accepted_by_pos
      records.append(rec)
    if bar is not None:
      bar.update(len(idx))
  return records


def _summary(records: list[PromptRecord], plain: dict) -> dict:
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
      **({"adaptive": _adaptive_summary([r.adaptive for r in records if r.adaptive])}
         if any(r.adaptive for r in records) else {}),
  }


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


def run_experiment(cfg: ExperimentConfig, progress: bool = True) -> dict:
  """Run plain decoding and every method of `cfg`; return the result dict (JSON-ready)."""
  target = load_model(cfg.target, dtype=jnp.dtype(cfg.dtype), progress=progress)
  questions = []
  for ps in cfg.prompts:
    questions += load_prompt_set(ps, limit=cfg.limit, categories=list(cfg.categories) or None)
  n_prompts = sum(min(cfg.turns, len(q.turns)) for q in questions)
  draft_cache: dict = {}
  methods = [None] + list(cfg.methods)
  bar = tqdm(total=n_prompts * len(methods), desc=f"bench {cfg.name}", unit="prompt", disable=not progress)
  t0 = time.perf_counter()
  by_method: dict[str, list[PromptRecord]] = {}
  if cfg.interleave:   # batch by batch, every method in turn
    runners = [(m, _Runner(cfg, target, m, draft_cache)) for m in methods]
    for start in range(0, len(questions), cfg.batch_size):
      batch = questions[start: start + cfg.batch_size]
      for m, runner in runners:
        by_method.setdefault(PLAIN if m is None else m.name, []).extend(run_batch(cfg, target, runner, m, batch, bar))
  else:
    for m in methods:
      bar.set_postfix_str(PLAIN if m is None else m.name)
      by_method[PLAIN if m is None else m.name] = run_method(cfg, target, m, questions, draft_cache, bar)
  bar.close()
  return result_dict(cfg, by_method, time.perf_counter() - t0)


def result_dict(cfg: ExperimentConfig, by_method: dict[str, list[PromptRecord]], wall: float) -> dict:
  """The result (JSON-ready) of measured records: each record is compared with plain decoding's
  answer to the same prompt, then summarized per method, overall and by category."""
  plain = {(r.question_id, r.turn): r for r in by_method.get(PLAIN, [])}
  for recs in by_method.values():
    for r in recs:
      ref = plain.get((r.question_id, r.turn))
      r.equal_to_plain = None if ref is None else (r.tokens == ref.tokens)
  summary = {}
  for name, recs in by_method.items():
    cats = defaultdict(list)
    for r in recs:
      cats[r.category].append(r)
    summary[name] = {"overall": _summary(recs, plain),
                     "by_category": {c: _summary(rs, plain) for c, rs in sorted(cats.items())}}
  return {
      "experiment": cfg.name,
      "config": to_dict(cfg),
      "git_revision": git_revision(),
      "device": device_info(),
      "wall_seconds": wall,
      "summary": summary,
      "prompts": {name: [{k: v for k, v in dataclasses.asdict(r).items() if k != "tokens"} for r in recs]
                  for name, recs in by_method.items()},
  }
