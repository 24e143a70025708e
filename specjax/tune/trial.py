"""Measuring one method on a list of questions: the bench harness's runner and rows (the same
warm-up, the same snapshot / restore of drafters with cross-request memory between repeats), with
a deadline checked before every generation call, and the harness's per-method summary."""

from __future__ import annotations

from specjax.bench.config import ExperimentConfig, MethodConfig
from specjax.bench.prompts import Question
from specjax.bench.records import PromptRecord, summarize as summarize_records
from specjax.bench.runner import WARM_TOKENS, Deadline, run_method

__all__ = ["WARM_TOKENS", "Deadline", "run_questions", "summarize"]


def run_questions(cfg: ExperimentConfig, target, method: MethodConfig | None, questions: list[Question],
                  draft_cache: dict | None = None, deadline: float | None = None) -> list[PromptRecord]:
  """`specjax.bench.runner.run_method` with a deadline: raises `Deadline` when time.perf_counter()
  passes `deadline` before a generation call."""
  return run_method(cfg, target, method, questions, {} if draft_cache is None else draft_cache,
                    warm_tokens=WARM_TOKENS, deadline=deadline)


def summarize(records: list[PromptRecord], plain: dict) -> dict:
  """The harness's per-method summary (tokens/s, speedup vs `plain`, tau, acceptance, ...)."""
  for r in records:
    ref = plain.get((r.question_id, r.turn))
    r.equal_to_plain = None if ref is None else (r.tokens == ref.tokens)
  return summarize_records(records, plain)
