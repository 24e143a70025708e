"""The order in which a dataset's rows are read (`specjax.train.data.build_dataset`): every source
of a `DataConfig` shuffled with the seed (prompt sets row by row, magpie queries in sampling order,
chat conversations through `specjax.train.chat_data`), interleaved round-robin, so shard s always
holds the same prompts and a bigger `n_sequences` extends a dataset instead of changing it."""

from __future__ import annotations

from typing import Iterator

import numpy as np


def reference_of(row: dict) -> str | None:
  """The answer shipped with a prompt-set row: GSM8K `answer` (calculator annotations removed),
  `reference[0]` (Alpaca, ShareGPT's reply, MT-bench format), HumanEval's prompt +
  `canonical_solution` as a code block; None where there is none."""
  import re
  if "answer" in row:
    return re.sub(r"<<[^>]*>>", "", row["answer"])
  if "canonical_solution" in row:
    return "```python\n" + row["prompt"] + row["canonical_solution"] + "```"
  if row.get("reference"):
    return row["reference"][0]
  return None


def references(name_or_path: str) -> list[str | None]:
  """`reference_of` each question of a prompt set, in `load_prompt_set` order."""
  from specjax.bench.prompts import PromptFile
  rows = PromptFile(name_or_path)
  return [reference_of(rows.row(k)) for k in range(len(rows))]


def _rows_in_order(rows, order, with_references: bool) -> Iterator[tuple[str, str | None]]:
  """(first turn, reference or None) of rows[k] for k in `order`, each read when it is needed."""
  for k in order:
    row = rows.row(int(k))
    yield rows.question(int(k), row).turns[0], reference_of(row) if with_references else None


def prompt_stream(dc: "DataConfig", encode, synthesized: dict[int, list[str]] | None = None, tok=None
                  ) -> Iterator[tuple[int, list[int], "str | ChatItem | None"]]:
  """(source index, chat-encoded prompt tokens, reference answer or None): each prompt set shuffled
  with the seed, each magpie source i in the order of `synthesized[i]` (its sampled queries),
  interleaved round-robin; prompts longer than max_prompt_len are skipped, and in "reference" mode
  so are questions without an answer. A chat source (read with the tokenizer `tok`) gives its
  conversations: (index, first prompt's tokens, `ChatItem`)."""
  from specjax.bench.prompts import PromptFile
  from specjax.train.chat_data import ChatItem, chat_items
  lists = []
  for i, src in enumerate(dc.sources):
    src.check()
    if src.is_chat:
      if tok is None:
        raise ValueError(f"source {i} (chat): its conversations are rendered with the target's tokenizer; none given")
      lists.append(chat_items(src, i, dc, tok))
      continue
    if src.is_magpie:
      if dc.responses == "reference":
        raise ValueError("a magpie source has no reference answers; use responses: target")
      if synthesized is None or i not in synthesized:
        raise ValueError(f"source {i} (magpie): its queries are sampled by build_dataset; none were given")
      lists.append([(q, None) for q in synthesized[i][:src.limit]])
      continue
    rows = PromptFile(src.name)
    order = np.random.default_rng(dc.seed + i).permutation(len(rows))
    lists.append(_rows_in_order(rows, order[:src.limit] if src.limit else order, dc.responses == "reference"))
  iters = [iter(t) for t in lists]
  live = list(range(len(iters)))
  while live:
    for i in list(live):
      item = next(iters[i], None)
      if item is None:
        live.remove(i)
        continue
      text, ref = item
      if dc.responses == "reference" and not ref:
        continue
      tokens = text if isinstance(ref, ChatItem) else encode(text)
      if len(tokens) <= dc.max_prompt_len:
        yield i, tokens, ref
