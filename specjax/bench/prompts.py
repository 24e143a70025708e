"""Prompt sets: Spec-Bench / MT-bench JSONL (`question_id`, `category`, `turns`), HumanEval
(`task_id`, `prompt`) and GSM8K (`question`, `answer`), read from any path at run time.

The default data folder is `$SPECJAX_DATA`, else `../shared/data` beside the checkout.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

DEFAULT_FILES = {"mt_bench": "mt_bench_question.jsonl", "humaneval": "HumanEval.jsonl",
                 "gsm8k": "gsm8k_train.jsonl", "alpaca": "alpaca_question.jsonl"}


@dataclasses.dataclass(frozen=True)
class Question:
  question_id: str
  category: str
  turns: tuple[str, ...]


def data_dir() -> Path:
  if os.environ.get("SPECJAX_DATA"):
    return Path(os.environ["SPECJAX_DATA"])
  here = Path(__file__).resolve().parents[2]
  for cand in (here.parent / "shared" / "data", here / "shared" / "data", Path.cwd().parent / "shared" / "data"):
    if cand.exists():
      return cand
  return here.parent / "shared" / "data"


def resolve(name_or_path: str | None) -> Path:
  """A prompt-set name (mt_bench, humaneval, gsm8k, alpaca) or a path."""
  if name_or_path is None:
    name_or_path = "mt_bench"
  if name_or_path in DEFAULT_FILES:
    path = data_dir() / DEFAULT_FILES[name_or_path]
  else:
    path = Path(name_or_path)
  if not path.exists():
    raise FileNotFoundError(f"prompt set {name_or_path!r} not found at {path} (set SPECJAX_DATA to the data folder)")
  return path


def _question(row: dict, i: int, source: str) -> Question:
  if "turns" in row:
    return Question(str(row.get("question_id", i)), row.get("category") or source, tuple(row["turns"]))
  if "task_id" in row and "prompt" in row:          # HumanEval
    return Question(str(row["task_id"]), "coding",
                    ("Complete the following Python function.\n\n```python\n" + row["prompt"] + "```",))
  if "question" in row:                             # GSM8K
    return Question(str(row.get("id", i)), "math", (row["question"],))
  raise ValueError(f"{source} line {i + 1}: unknown prompt format with keys {sorted(row)}")


def load_prompt_set(name_or_path: str | None = None, limit: int | None = None,
                    categories: list[str] | None = None) -> list[Question]:
  path = resolve(name_or_path)
  out = []
  with open(path) as f:
    for i, line in enumerate(f):
      if not line.strip():
        continue
      q = _question(json.loads(line), i, path.stem)
      if categories and q.category not in categories:
        continue
      out.append(q)
      if limit and len(out) >= limit:
        break
  return out
