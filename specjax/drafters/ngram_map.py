"""`ngram_map_k` / `ngram_map_k4v`: llama.cpp's n-gram maps, keys with hit counts (and, for k4v,
up to four following m-grams per key with counts), over an incremental n-gram index of the history
(`specjax.drafters.ngram_index`)."""

from __future__ import annotations

import bisect

from specjax.drafters.ngram_index import NgramIndex, PerSequenceDrafter, check_positive

MAX_VALUES = 4                 # llama.cpp COMMON_NGRAM_MAX_VALUES
MAX_COUNT = 16380              # llama.cpp COMMON_NGRAM_MAX_VALUE_COUNT (counts saturate)


class _KeyStats:
  __slots__ = ("hits", "cap", "values", "n_counted")

  def __init__(self, size_m: int):
    self.hits = 0                                   # drafting lookups that found this key
    self.cap = size_m                               # key-only mode: tokens accepted last time
    self.values: dict[tuple[int, ...], list[int]] = {}   # m-gram -> [count, accepted last time]
    self.n_counted = 0                              # occurrences (index into starts) already counted


class _MapState:
  __slots__ = ("index", "keys", "last")

  def __init__(self, index: NgramIndex):
    self.index = index
    self.keys: dict[tuple[int, ...], _KeyStats] = {}
    self.last: tuple | None = None                  # (key stats, value or None) of the last draft


class _NgramMap(PerSequenceDrafter):
  """llama.cpp's ngram map: a key occurrence counts only when a full m-gram follows it."""

  key_only = True

  def __init__(self, size_n: int, size_m: int, min_hits: int = 1):
    super().__init__()
    check_positive(size_n=size_n, size_m=size_m, min_hits=min_hits)
    self.size_n, self.size_m, self.min_hits = int(size_n), int(size_m), int(min_hits)
    self.max_draft = self.size_m

  def _new_state(self, prompt):
    return _MapState(NgramIndex(self.size_n, prompt))

  def _draft_one(self, st: _MapState, history, n):
    st.last = None
    toks = st.index.sync(history)
    size_n, size_m, length = self.size_n, self.size_m, len(toks)
    if length < size_n or n <= 0:
      return []
    key = tuple(toks[length - size_n:])
    starts = st.index.starts.get(key, ())
    pos = bisect.bisect_right(starts, length - size_n - size_m) - 1       # j + n + m <= length
    if pos < 0:
      return []
    j = starts[pos]
    ks = st.keys.get(key)
    if ks is None:
      ks = st.keys[key] = _KeyStats(size_m)
    ks.hits = min(ks.hits + 1, MAX_COUNT)
    if self.key_only:
      st.last = (ks, None)
      return toks[j + size_n: j + size_n + min(size_m, ks.cap, n)]
    if ks.hits < self.min_hits:
      return []
    for s in starts[ks.n_counted: pos + 1]:          # each occurrence is counted once
      value = tuple(toks[s + size_n: s + size_n + size_m])
      stats = ks.values.get(value)
      if stats is not None:
        stats[0] = min(stats[0] + 1, MAX_COUNT)
      elif len(ks.values) < MAX_VALUES:
        ks.values[value] = [1, size_m]
    ks.n_counted = pos + 1
    best, best_count, total = None, 0, 0
    for value, (count, _) in ks.values.items():     # first value wins ties, as llama.cpp's slot order
      total += count
      if count > best_count:
        best, best_count = value, count
    others = total - best_count
    if best is None or (others > 0 and best_count < 3 * others):
      return []                                      # contested: no draft
    st.last = (ks, best)
    return list(best[:min(size_m, ks.values[best][1], n)])

  def _accept_one(self, st: _MapState, n_accepted, verified):
    if st.last is not None and verified:
      ks, value = st.last
      if value is None:
        ks.cap = n_accepted
      else:
        ks.values[value][1] = n_accepted
    st.last = None


class NgramMapK(_NgramMap):
  """Keys with hit counts; the draft after a key is capped by its tokens accepted last time.

  llama.cpp never records the acceptance in key-only mode (its accept returns early because the
  draft is not flagged as created); we apply the cap as documented.
  """

  name = "ngram_map_k"
  key_only = True

  def __init__(self, size_n: int = 12, size_m: int = 48):
    super().__init__(size_n, size_m)


class NgramMapK4V(_NgramMap):
  """Up to 4 values per key with counts; draft the winner if the key has `min_hits` hits and
  max >= 3 * sum(others); length capped by that value's tokens accepted last time.

  Unlike llama.cpp (which then copies the tokens after the most recent occurrence, whichever value
  they are, and counts that occurrence again on the next lookup) we draft the winning value and
  count each occurrence once.
  """

  name = "ngram_map_k4v"
  key_only = False

  def __init__(self, size_n: int = 12, size_m: int = 48, min_hits: int = 1):
    super().__init__(size_n, size_m, min_hits)
