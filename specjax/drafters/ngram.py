"""Model-free n-gram speculators on the host, after llama.cpp's `common/ngram-map.cpp`,
`ngram-mod.cpp`, `ngram-cache.cpp` and `speculative.cpp` (behaviour and defaults, not code).

All five are `HostDrafter`s: the engine calls `begin(prompts)` once per request batch,
`propose(histories, n_max)` every round with each sequence's full history (prompt + generated, the
newest token last) and `accept(n_accepted)` after verification.

- `NgramSimple`  (size_n=12, size_m=48): the key is the last n tokens; draft the up-to-m tokens that
  followed its most recent earlier occurrence. Keeps only an index of the history.
- `NgramMapK`    (size_n=12, size_m=48): as simple, over a map of keys with hit counts; the draft
  after a key is capped by how many of its tokens were accepted the last time it was drafted.
- `NgramMapK4V`  (size_n=12, size_m=48, min_hits=1): per key up to 4 distinct following m-grams
  ("values") with counts; the most frequent value is drafted unless contested
  (max < 3 * sum of the others) or the key has fewer than `min_hits` hits.
- `NgramMod`     (n_match=24, n_min=48, n_max=64): one flat int32 table (4M entries) shared by all
  sequences, index = multiplicative hash of n tokens, value = the next token; drafting is a rolling
  lookup. `ngram_mod_hash` / `ngram_mod_lookup` are pure and run unchanged on numpy or jnp arrays.
- `NgramCache`   (n_draft=8): lookup decoding with n=1..4 context counts per request, an optional
  dynamic cache (file) and an optional static cache of 2-grams built from a corpus
  (`build_static_cache`); files use llama.cpp's lookup-cache format.

Isolation: everything a sequence's speculator learned (indexes, key maps, context caches, low
acceptance streaks) is dropped in `begin`, unlike llama.cpp whose context cache leaks across
requests (ggml-org/llama.cpp issue 27852). By design only `NgramMod`'s table persists across
`begin` calls (it is a shared, lossy cache), and `NgramCache`'s dynamic cache when
`update_dynamic=True` is asked for explicitly.

`accept(n_accepted, verified=None)` takes an optional [B] bool mask: False means the sequence's
draft was not verified (a chain chose another speculator's draft), which llama.cpp calls
`is_other`; such a round teaches the speculator nothing.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import os
from collections.abc import Iterable, Sequence

import numpy as np

from specjax.drafters.base import HostDrafter

EMPTY = -1                               # empty NgramMod table entry / padding of a cache key


# ------------------------------------------------------------------------------------------------
# Shared pieces


@contextlib.contextmanager
def gc_paused():
  """Pause Python's cyclic garbage collector while building many small containers (n-gram maps,
  trie nodes; none of them form cycles): otherwise its collections rescan the growing structure
  and take most of the time (10x for n-gram counts)."""
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if was_enabled:
      gc.enable()


class _NgramIndex:
  """Incremental index of one token history: n-gram (tuple) -> start positions, ascending."""

  __slots__ = ("n", "tokens", "starts")

  def __init__(self, n: int, tokens: Sequence[int] = ()):
    self.n = n
    self.tokens: list[int] = []
    self.starts: dict[tuple[int, ...], list[int]] = {}
    self.sync(tokens)

  def sync(self, history: Sequence[int]) -> list[int]:
    """Index the tokens of `history` past those already seen; `history` must extend them."""
    seen = len(self.tokens)
    if len(history) < seen or (seen and history[seen - 1] != self.tokens[seen - 1]):
      raise ValueError("history does not extend the one this sequence began with; call begin() "
                       "for a new request")
    if len(history) > seen:
      self.tokens.extend(int(t) for t in history[seen:])
      toks, n, starts = self.tokens, self.n, self.starts
      with gc_paused():
        for s in range(max(0, seen - n + 1), len(toks) - n + 1):
          starts.setdefault(tuple(toks[s:s + n]), []).append(s)
    return self.tokens


def _pack(drafts: list[list[int]], k: int) -> tuple[np.ndarray, np.ndarray]:
  """Ragged drafts -> (tokens [B, K] int32, lengths [B] int32)."""
  tokens = np.zeros((len(drafts), k), np.int32)
  lengths = np.zeros((len(drafts),), np.int32)
  for i, d in enumerate(drafts):
    tokens[i, :len(d)] = d
    lengths[i] = len(d)
  return tokens, lengths


class _PerSequenceDrafter(HostDrafter):
  """Host-drafter skeleton: one state per sequence, made in `begin`, driven per sequence.

  Subclasses set `name`, `max_draft` and implement `_new_state(prompt)`,
  `_draft_one(state, history, n) -> list[int]` (at most n tokens) and
  `_accept_one(state, n_accepted, verified)`. Constructor arguments are configuration and are not
  changed afterwards; per-request state lives in `_states`.
  """

  max_draft: int = 0

  def __init__(self):
    self._states: list = []

  def begin(self, prompts: list[list[int]]) -> None:
    self._states = [self._new_state(list(p)) for p in prompts]

  def propose(self, histories: list[list[int]], n_max) -> tuple[np.ndarray, np.ndarray, None]:
    b = len(histories)
    if b != len(self._states):
      raise ValueError(f"{self.name}: propose() for {b} sequences after begin() for {len(self._states)}")
    budget = np.minimum(np.broadcast_to(np.asarray(n_max, np.int64), (b,)), self.max_draft)
    drafts = [self._draft_one(st, h, int(n))[:max(int(n), 0)] for st, h, n in zip(self._states, histories, budget)]
    tokens, lengths = _pack(drafts, self.max_draft)
    return tokens, lengths, None

  def accept(self, n_accepted, verified=None) -> None:
    n_acc = np.asarray(n_accepted).reshape(-1)
    ver = np.ones(len(self._states), bool) if verified is None else np.asarray(verified, bool).reshape(-1)
    for st, n, v in zip(self._states, n_acc, ver):
      self._accept_one(st, int(n), bool(v))

  def _new_state(self, prompt: list[int]):
    raise NotImplementedError

  def _draft_one(self, state, history: Sequence[int], n: int) -> list[int]:
    raise NotImplementedError

  def _accept_one(self, state, n_accepted: int, verified: bool) -> None:
    pass


def _check_positive(**kw) -> None:
  for k, v in kw.items():
    if int(v) < 1:
      raise ValueError(f"{k} must be >= 1, got {v}")


# ------------------------------------------------------------------------------------------------
# ngram_simple


class NgramSimple(_PerSequenceDrafter):
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
    _check_positive(size_n=size_n, size_m=size_m)
    self.size_n, self.size_m = int(size_n), int(size_m)
    self.max_draft = self.size_m

  def _new_state(self, prompt):
    return _NgramIndex(self.size_n, prompt)

  def _draft_one(self, index: _NgramIndex, history, n):
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


# ------------------------------------------------------------------------------------------------
# ngram_map_k / ngram_map_k4v

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

  def __init__(self, index: _NgramIndex):
    self.index = index
    self.keys: dict[tuple[int, ...], _KeyStats] = {}
    self.last: tuple | None = None                  # (key stats, value or None) of the last draft


class _NgramMap(_PerSequenceDrafter):
  """llama.cpp's ngram map: a key occurrence counts only when a full m-gram follows it."""

  key_only = True

  def __init__(self, size_n: int, size_m: int, min_hits: int = 1):
    super().__init__()
    _check_positive(size_n=size_n, size_m=size_m, min_hits=min_hits)
    self.size_n, self.size_m, self.min_hits = int(size_n), int(size_m), int(min_hits)
    self.max_draft = self.size_m

  def _new_state(self, prompt):
    return _MapState(_NgramIndex(self.size_n, prompt))

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


# ------------------------------------------------------------------------------------------------
# ngram_mod

NGRAM_MOD_MULT = 6364136223846793005     # llama.cpp's multiplier (an LCG constant)
_MASK32 = 0xFFFFFFFF


def _powers(n: int) -> np.ndarray:
  """[n] uint32: MULT^(n-1-i) mod 2^32, so hash = sum(tokens * powers) mod 2^32."""
  m, out, p = NGRAM_MOD_MULT & _MASK32, [], 1
  for _ in range(n):
    out.append(p)
    p = (p * m) & _MASK32
  return np.asarray(out[::-1], np.uint32)


def _array_module(x):
  if isinstance(x, np.ndarray):
    return np
  import jax.numpy as jnp
  return jnp


def ngram_mod_hash(tokens, size: int):
  """tokens [..., n] int -> table index [...] int32 in [0, size).

  h = ((t0 * M + t1) * M + ...) mod 2^32, index = h mod size. For power-of-two sizes (the default
  4M) this is exactly llama.cpp's index, whose 64-bit hash reduces to the same low bits. Pure and
  array-module agnostic: numpy arrays stay on the host, jax arrays work under jit.
  """
  xp = _array_module(tokens)
  powers = xp.asarray(_powers(tokens.shape[-1]))
  h = xp.sum(tokens.astype(xp.uint32) * powers, axis=-1, dtype=xp.uint32)
  return (h % xp.uint32(size)).astype(xp.int32)


def ngram_mod_lookup(table, tokens):
  """table [S] int32, tokens [..., n] -> [...] int32 next token (EMPTY = -1 when unknown)."""
  return table[ngram_mod_hash(tokens, table.shape[0])]


class _ModState:
  __slots__ = ("i_next", "n_draft_last", "n_low")

  def __init__(self):
    self.i_next = 0           # first n-gram start not yet added to the table
    self.n_draft_last = 0     # length of the last draft
    self.n_low = 0            # consecutive verified rounds with acceptance < low_accept


class NgramMod(_PerSequenceDrafter):
  """Hashed n-gram -> next-token table shared by all sequences, with llama.cpp's reset rules.

  The table persists across `begin` calls on purpose (it is what the speculator is: a lossy,
  shared memory of text seen). It is reset when more than `reset_occupancy` of its entries have
  been written over (checked in `begin`, before the new prompts are added; llama.cpp checks after
  adding and so throws the new prompts away), and when a sequence has `low_rounds` verified drafts
  in a row with acceptance below `low_accept`; every sequence then adds its history again.
  New n-grams of a sequence are added once more than `add_chunk` tokens are pending, as llama.cpp.
  A draft shorter than `n_min` (or than the round's budget, when that is smaller) is not offered.
  """

  name = "ngram_mod"
  cross_request_memory = True     # the shared table outlives a request by design

  def __init__(self, n_match: int = 24, n_min: int = 48, n_max: int = 64, table_size: int = 4 * 1024 * 1024,
               add_chunk: int = 32, low_accept: float = 0.5, low_rounds: int = 3, reset_occupancy: float = 0.25):
    super().__init__()
    _check_positive(n_match=n_match, n_max=n_max, table_size=table_size, low_rounds=low_rounds)
    if not 0 <= n_min <= n_max:
      raise ValueError(f"n_min must be in [0, n_max], got n_min={n_min}, n_max={n_max}")
    if table_size >= 2 ** 31:
      raise ValueError(f"table_size must be < 2^31, got {table_size}")
    self.n_match, self.n_min, self.n_max = int(n_match), int(n_min), int(n_max)
    self.add_chunk, self.low_accept, self.low_rounds = int(add_chunk), float(low_accept), int(low_rounds)
    self.reset_occupancy = float(reset_occupancy)
    self.max_draft = self.n_max
    self.table = np.full((int(table_size),), EMPTY, np.int32)      # [S] int32, shared
    self.n_overwritten = 0        # adds into an entry that was not empty (llama.cpp's `used`)
    self.n_resets = 0
    self._powers = _powers(self.n_match)
    self._top_power = int(self._powers[0])                         # MULT^(n-1) mod 2^32

  def reset_table(self) -> None:
    self.table.fill(EMPTY)
    self.n_overwritten = 0
    self.n_resets += 1
    for st in self._states:
      st.i_next = 0

  def begin(self, prompts):
    if self.n_overwritten > self.reset_occupancy * self.table.shape[0]:
      self.reset_table()
    super().begin(prompts)
    for st, p in zip(self._states, prompts):
      self._add(st, p)

  def _new_state(self, prompt):
    return _ModState()

  def _add(self, st: _ModState, toks: Sequence[int]) -> None:
    """Add every n-gram -> next token pair of `toks` starting at or after st.i_next."""
    n = self.n_match
    stop = len(toks) - n                               # last start with a next token, exclusive
    if stop <= st.i_next:
      return
    arr = np.asarray(toks[st.i_next:], np.int32)
    windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)          # [W, n]
    idx = ngram_mod_hash(windows, self.table.shape[0])                       # [W]
    nxt = arr[n:]                                                             # [W]
    filled = self.table[idx] != EMPTY
    # llama.cpp counts every add into a non-empty entry, repeats within this batch included
    self.n_overwritten += int(filled.sum()) + int((~filled).sum()) - len(np.unique(idx[~filled]))
    self.table[idx] = nxt                              # the last write of an index wins, as sequentially
    st.i_next = stop

  def _draft_one(self, st: _ModState, history, n):
    st.n_draft_last = 0
    length, n_match = len(history), self.n_match
    if length < n_match or n <= 0:
      return []
    if st.i_next + self.add_chunk < length - 1:
      self._add(st, history)
    limit = min(self.n_max, n)
    key = [int(t) for t in history[length - n_match:]]
    h = 0
    for t in key:
      h = (h * NGRAM_MOD_MULT + t) & _MASK32
    size, table, mult, top = self.table.shape[0], self.table, NGRAM_MOD_MULT & _MASK32, self._top_power
    draft: list[int] = []
    while len(draft) < limit:                          # rolling lookup: look up, append, shift
      tok = int(table[h % size])
      if tok == EMPTY:
        break
      draft.append(tok)
      h = ((h - key[0] * top) * mult + tok) & _MASK32
      key.pop(0)
      key.append(tok)
    if len(draft) < min(self.n_min, limit):
      return []
    st.n_draft_last = len(draft)
    return draft

  def _accept_one(self, st: _ModState, n_accepted, verified):
    if verified and st.n_draft_last > 0:
      if n_accepted / st.n_draft_last < self.low_accept:
        st.n_low += 1
        if st.n_low >= self.low_rounds:
          self.reset_table()
          st.n_low = 0
      else:
        st.n_low = 0
    st.n_draft_last = 0


# ------------------------------------------------------------------------------------------------
# ngram_cache (lookup decoding)

NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2        # llama.cpp LLAMA_NGRAM_MIN / _MAX / _STATIC
# A candidate is dropped when its sample size or share is below these, per n-gram size 1..4:
MIN_SAMPLES_LAX = (2, 2, 1, 1)
MIN_PERCENT_LAX = (66, 50, 50, 50)
MIN_SAMPLES_STRICT = (4, 3, 2, 2)
MIN_PERCENT_STRICT = (75, 66, 66, 66)

NgramCounts = dict[tuple[int, ...], dict[int, int]]   # n-gram -> {next token: count}


def update_ngram_counts(counts: NgramCounts, tokens: Sequence[int], n_new: int,
                        n_min: int = NGRAM_MIN, n_max: int = NGRAM_MAX) -> NgramCounts:
  """Count, for the last `n_new` positions of `tokens`, each n-gram (n_min..n_max) before them."""
  length = len(tokens)
  first = max(length - n_new, 0)
  offset = max(first - n_max, 0)
  toks = [int(t) for t in tokens[offset:]]             # only these take part
  with gc_paused():
    for i in range(first - offset, length - offset):
      nxt = toks[i]
      for n in range(n_min, min(n_max, i + offset) + 1):
        key = tuple(toks[i - n:i])
        part = counts.get(key)
        if part is None:
          counts[key] = {nxt: 1}
        else:
          part[nxt] = part.get(nxt, 0) + 1
  return counts


def merge_ngram_counts(target: NgramCounts, add: NgramCounts) -> NgramCounts:
  for key, part in add.items():
    dst = target.setdefault(key, {})
    for tok, c in part.items():
      dst[tok] = dst.get(tok, 0) + c
  return target


def save_ngram_cache(counts: NgramCounts, path) -> None:
  """llama.cpp lookup-cache file: per n-gram, 4 int32 tokens (-1 padded), int32 k, k x (token, count)."""
  chunks = []
  for key, part in counts.items():
    if not part:
      continue
    head = list(key) + [EMPTY] * (NGRAM_MAX - len(key)) + [len(part)]
    body = [x for tok_count in part.items() for x in tok_count]
    chunks.append(np.asarray(head + body, np.int32))
  data = np.concatenate(chunks) if chunks else np.zeros((0,), np.int32)
  with open(path, "wb") as f:
    f.write(data.astype("<i4").tobytes())


def load_ngram_cache(path) -> NgramCounts:
  data = np.fromfile(path, dtype="<i4").tolist()
  counts: NgramCounts = {}
  with gc_paused():
    _parse_ngram_cache(data, counts, path)
  return counts


def _parse_ngram_cache(data: list[int], counts: NgramCounts, path) -> None:
  i = 0
  while i < len(data):
    if i + NGRAM_MAX + 1 > len(data):
      raise ValueError(f"{path}: truncated n-gram cache record at int {i}")
    key = tuple(t for t in data[i:i + NGRAM_MAX] if t != EMPTY)
    k = data[i + NGRAM_MAX]
    i += NGRAM_MAX + 1
    if k <= 0 or i + 2 * k > len(data):
      raise ValueError(f"{path}: bad n-gram cache record (k={k})")
    part = counts.setdefault(key, {})
    for tok, c in zip(data[i:i + 2 * k:2], data[i + 1:i + 2 * k:2]):
      part[tok] = part.get(tok, 0) + c
    i += 2 * k


def build_static_cache(texts_or_token_lists: Iterable, path=None, tokenizer=None) -> NgramCounts:
  """Static cache: 2-gram -> next-token counts over a corpus (llama.cpp `lookup-create`).

  Items are token lists, or strings encoded with `tokenizer.encode`. Saved to `path` if given.
  """
  counts: NgramCounts = {}
  for item in texts_or_token_lists:
    if isinstance(item, str):
      if tokenizer is None:
        raise ValueError("build_static_cache: text items need a tokenizer")
      item = tokenizer.encode(item)
    toks = [int(t) for t in item]
    update_ngram_counts(counts, toks, len(toks), NGRAM_STATIC, NGRAM_STATIC)
  if path is not None:
    save_ngram_cache(counts, path)
  return counts


def _try_primary(cache: NgramCounts, keys: list[tuple[int, ...]], part_static: dict[int, int],
                 min_samples: Sequence[int], min_percent: Sequence[int]) -> int | None:
  """Longest n-gram first; the winner maximises count * (100 * static count, or 1)."""
  for key in reversed(keys):
    part = cache.get(key)
    if not part:
      continue
    best, best_count, best_weight, total = None, 0, 0, 0
    for tok, c in part.items():
      w = 100 * part_static[tok] if tok in part_static else 1
      if c * w > best_count * best_weight:
        best, best_count, best_weight = tok, c, w
      total += c
    i = len(key) - 1
    if total < min_samples[i] or 100 * best_count < min_percent[i] * total:
      continue
    return best
  return None


def _try_static(part_static: dict[int, int]) -> int | None:
  if not part_static:
    return None
  best, best_count, total = None, 0, 0
  for tok, c in part_static.items():
    if c > best_count:
      best, best_count = tok, c
    total += c
  i = NGRAM_STATIC - 1
  if total < MIN_SAMPLES_LAX[i] or 100 * best_count < MIN_PERCENT_LAX[i] * total:
    return None
  return best


class _CacheState:
  __slots__ = ("context", "tokens", "merged")

  def __init__(self):
    self.context: NgramCounts = {}
    self.tokens: list[int] = []
    self.merged = False


class NgramCache(_PerSequenceDrafter):
  """Lookup decoding: extend the draft one token at a time from the context cache (n=4..1, lax
  thresholds), else the dynamic cache (strict thresholds), else the static 2-gram cache; stop at the
  first position with no candidate. Context and dynamic candidates are weighed by static counts.

  The context cache is per request and dropped in `begin`. `static` / `dynamic` are counts or file
  paths (llama.cpp format). With `update_dynamic=True` each request's context counts are merged into
  the dynamic cache at the next `begin` (or `flush`) -- an explicit opt-in to cross-request
  learning, as llama.cpp's lookup example does across runs; `save_dynamic(path)` writes it.
  """

  name = "ngram_cache"
  cross_request_memory = True     # the dynamic cache, when update_dynamic=True

  def __init__(self, n_draft: int = 8, static=None, dynamic=None, update_dynamic: bool = False):
    super().__init__()
    _check_positive(n_draft=n_draft)
    self.n_draft = int(n_draft)
    self.max_draft = self.n_draft
    self.static: NgramCounts = self._counts(static)
    self.dynamic: NgramCounts = self._counts(dynamic)
    self.update_dynamic = bool(update_dynamic)

  @staticmethod
  def _counts(src) -> NgramCounts:
    if src is None:
      return {}
    if isinstance(src, (str, os.PathLike)):
      return load_ngram_cache(src)
    return {tuple(k): dict(v) for k, v in src.items()}

  def flush(self) -> None:
    """Merge the current requests' context counts into the dynamic cache (update_dynamic only)."""
    if self.update_dynamic:
      for st in self._states:
        if not st.merged:
          merge_ngram_counts(self.dynamic, st.context)
          st.merged = True

  def save_dynamic(self, path) -> None:
    self.flush()
    save_ngram_cache(self.dynamic, path)

  def begin(self, prompts):
    self.flush()
    super().begin(prompts)

  def _new_state(self, prompt):
    st = _CacheState()
    self._sync(st, prompt)
    return st

  @staticmethod
  def _sync(st: _CacheState, history) -> list[int]:
    seen = len(st.tokens)
    if len(history) < seen or (seen and history[seen - 1] != st.tokens[seen - 1]):
      raise ValueError("history does not extend the one this sequence began with; call begin() "
                       "for a new request")
    if len(history) > seen:
      st.tokens.extend(int(t) for t in history[seen:])
      update_ngram_counts(st.context, st.tokens, len(st.tokens) - seen)
    return st.tokens

  def _draft_one(self, st: _CacheState, history, n):
    toks = self._sync(st, history)
    if len(toks) < NGRAM_STATIC or n <= 0:
      return []
    tail = toks[-NGRAM_MAX:]                           # only the last NGRAM_MAX tokens form keys
    draft: list[int] = []
    while len(draft) < n:
      ctx = tail + draft
      keys = [tuple(ctx[len(ctx) - k:]) for k in range(NGRAM_MIN, min(NGRAM_MAX, len(ctx)) + 1)]
      part_static = self.static.get(tuple(ctx[len(ctx) - NGRAM_STATIC:]), {})
      tok = _try_primary(st.context, keys, part_static, MIN_SAMPLES_LAX, MIN_PERCENT_LAX)
      if tok is None:
        tok = _try_primary(self.dynamic, keys, part_static, MIN_SAMPLES_STRICT, MIN_PERCENT_STRICT)
      if tok is None:
        tok = _try_static(part_static)
      if tok is None:
        break
      draft.append(tok)
    return draft
