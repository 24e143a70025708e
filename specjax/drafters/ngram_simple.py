"""`ngram_simple`: prompt-lookup drafting over an incremental n-gram index of the history
(`specjax.drafters.ngram_index`)."""

from __future__ import annotations

import bisect

from specjax.drafters.ngram_index import NgramIndex, PerSequenceDrafter, check_positive


class NgramSimple(PerSequenceDrafter):
  """Prompt-lookup drafting: the up-to-`size_m` tokens after the most recent earlier occurrence of
  the last `size_n` tokens.

  As in llama.cpp, a draft shorter than `size_n` is not offered, so an occurrence counts only if at
  least `size_n` tokens follow it in the history; unlike llama.cpp we then keep looking further
  back instead of giving up when the most recent occurrence is too close to the end (short-period
  loops), and position 0 may match. Stateless apart from an incremental index of the history.
  """

  name = "ngram_simple"

  def __init__(self, size_n: int = 12, size_m: int = 48):
    super().__init__()
    check_positive(size_n=size_n, size_m=size_m)
    self.size_n, self.size_m = int(size_n), int(size_m)
    self.max_draft = self.size_m

  def _new_state(self, prompt):
    return NgramIndex(self.size_n, prompt)

  def _draft_one(self, index: NgramIndex, history, n):
    toks = index.sync(history)
    size_n, length = self.size_n, len(toks)
    min_len = min(size_n, self.size_m)
    starts = index.starts.get(tuple(toks[length - size_n:])) if length >= size_n else None
    if not starts or n <= 0:
      return []
    pos = bisect.bisect_right(starts, length - size_n - min_len) - 1        # j + n + min_len <= length
    if pos < 0:
      return []
    j = starts[pos]
    return toks[j + size_n: j + size_n + min(self.size_m, n)]
