"""What a bench run measures and what it sums to: one `PromptRecord` per prompt (question,
turn) and method, summarised per method and written as the run's result.

Measured as Spec-Bench measures: per prompt the new tokens and wall time of the generation; per
method the speedup is the mean over prompts of (tokens/s of the method) / (tokens/s of plain
decoding on that prompt); `equal` is the fraction of outputs identical to plain decoding's
(meaningful for greedy).
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
from collections import defaultdict

import numpy as np

from specjax.bench import env
from specjax.bench.config import PLAIN_NAME, ExperimentConfig, to_dict

PLAIN = PLAIN_NAME


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
