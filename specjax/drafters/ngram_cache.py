"""`ngram_cache`: lookup decoding over n-gram counts of the request's context, an optional
dynamic cache and an optional static cache of 2-grams, and the counts' file format (llama.cpp's
lookup-cache files)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np

from specjax.drafters.ngram_index import EMPTY, PerSequenceDrafter, check_positive, extend_history, gc_paused

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


class NgramCache(PerSequenceDrafter):
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
    check_positive(n_draft=n_draft)
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
    seen = extend_history(st.tokens, history)
    if len(st.tokens) > seen:
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
