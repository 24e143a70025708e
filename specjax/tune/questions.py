"""The prompts of a tune run: the seeded, per-category split into tuning and held-out questions."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from specjax.bench.prompts import Question
from specjax.tune.config import TuneError


def split_questions(questions: list[Question], holdout_fraction: float, seed: int
                    ) -> tuple[list[Question], list[Question]]:
  """(tune, held-out): per category a seeded shuffle, round(fraction * n) held out (at least one
  question stays on each side when the category has two or more). Tune questions are interleaved
  across categories so any prefix (a halving rung) covers the categories evenly."""
  rng = np.random.default_rng(seed)
  by_cat: dict[str, list[Question]] = defaultdict(list)
  for q in questions:
    by_cat[q.category].append(q)
  tune_by_cat, holdout = [], []
  for cat in sorted(by_cat):
    qs = [by_cat[cat][i] for i in rng.permutation(len(by_cat[cat]))]
    n_hold = int(round(holdout_fraction * len(qs)))
    if len(qs) >= 2:
      n_hold = min(max(n_hold, 1), len(qs) - 1)
    holdout += qs[:n_hold]
    tune_by_cat.append(qs[n_hold:])
  tune = []
  for i in range(max((len(t) for t in tune_by_cat), default=0)):
    tune += [t[i] for t in tune_by_cat if i < len(t)]
  if not tune or not holdout:
    raise TuneError(f"{len(questions)} question(s) cannot be split into tuning and held-out sets; "
                    "raise `limit` or change holdout_fraction")
  return tune, holdout


def write_questions(questions: list[Question], path: Path) -> Path:
  """MT-bench style JSONL that `load_prompt_set(path)` reads back."""
  path.write_text("".join(json.dumps({"question_id": q.question_id, "category": q.category,
                                      "turns": list(q.turns)}) + "\n" for q in questions))
  return path
