"""What the host n-gram speculators share: an incremental index of a token history and the
per-sequence `HostDrafter` skeleton they are written on.

The speculators, after llama.cpp's `common/ngram-map.cpp`, `ngram-mod.cpp`, `ngram-cache.cpp` and
`speculative.cpp` (behaviour and defaults, not code), one file per family:

- `ngram_simple.NgramSimple`  (size_n=12, size_m=48): the key is the last n tokens; draft the
  up-to-m tokens that followed its most recent earlier occurrence. Keeps only an index of the history.
- `ngram_map.NgramMapK`       (size_n=12, size_m=48): as simple, over a map of keys with hit counts;
  the draft after a key is capped by how many of its tokens were accepted the last time it was drafted.
- `ngram_map.NgramMapK4V`     (size_n=12, size_m=48, min_hits=1): per key up to 4 distinct following
  m-grams ("values") with counts; the most frequent value is drafted unless contested
  (max < 3 * sum of the others) or the key has fewer than `min_hits` hits.
- `ngram_mod.NgramMod`        (n_match=24, n_min=48, n_max=64): one flat int32 table (4M entries)
  shared by all sequences, index = multiplicative hash of n tokens, value = the next token; drafting
  is a rolling lookup. `ngram_mod_hash` / `ngram_mod_lookup` are pure and run unchanged on numpy or
  jnp arrays.
- `ngram_cache.NgramCache`    (n_draft=8): lookup decoding with n=1..4 context counts per request, an
  optional dynamic cache (file) and an optional static cache of 2-grams built from a corpus
  (`build_static_cache`); files use llama.cpp's lookup-cache format.

All are `HostDrafter`s: the engine calls `begin(prompts)` once per request batch,
`propose(histories, n_max)` every round with each sequence's full history (prompt + generated, the
newest token last) and `accept(n_accepted)` after verification.

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

import contextlib
import gc
from collections.abc import Sequence

import numpy as np

from specjax.drafters.base import HostDrafter

EMPTY = -1                               # no token: an empty NgramMod table entry, the padding of a cache key


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


def extend_history(tokens: list[int], history: Sequence[int]) -> int:
  """Append to `tokens` (a sequence's history so far) the tokens of `history` past them; `history`
  must extend them. -> the length `tokens` had before."""
  seen = len(tokens)
  if len(history) < seen or (seen and history[seen - 1] != tokens[seen - 1]):
    raise ValueError("history does not extend the one this sequence began with; call begin() "
                     "for a new request")
  tokens.extend(int(t) for t in history[seen:])
  return seen


class NgramIndex:
  """Incremental index of one token history: n-gram (tuple) -> start positions, ascending."""

  __slots__ = ("n", "tokens", "starts")

  def __init__(self, n: int, tokens: Sequence[int] = ()):
    self.n = n
    self.tokens: list[int] = []
    self.starts: dict[tuple[int, ...], list[int]] = {}
    self.sync(tokens)

  def sync(self, history: Sequence[int]) -> list[int]:
    """Index the tokens of `history` past those already seen; `history` must extend them."""
    seen = extend_history(self.tokens, history)
    if len(self.tokens) > seen:
      toks, n, starts = self.tokens, self.n, self.starts
      with gc_paused():
        for s in range(max(0, seen - n + 1), len(toks) - n + 1):
          starts.setdefault(tuple(toks[s:s + n]), []).append(s)
    return self.tokens


def pack_drafts(drafts: list[list[int]], k: int) -> tuple[np.ndarray, np.ndarray]:
  """Ragged drafts -> (tokens [B, K] int32, lengths [B] int32)."""
  tokens = np.zeros((len(drafts), k), np.int32)
  lengths = np.zeros((len(drafts),), np.int32)
  for i, d in enumerate(drafts):
    tokens[i, :len(d)] = d
    lengths[i] = len(d)
  return tokens, lengths


class PerSequenceDrafter(HostDrafter):
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
    tokens, lengths = pack_drafts(drafts, self.max_draft)
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


def check_positive(**kw) -> None:
  for k, v in kw.items():
    if int(v) < 1:
      raise ValueError(f"{k} must be >= 1, got {v}")
