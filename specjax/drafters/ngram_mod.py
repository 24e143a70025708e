"""`ngram_mod`: one hashed n-gram -> next-token table shared by every sequence and request, with
llama.cpp's reset rules. The hash and the lookup are pure and array-module agnostic, so the device
implementation (`specjax.drafters.ngram_mod_device`) uses the same ones."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specjax.drafters.ngram_index import EMPTY, PerSequenceDrafter, check_positive

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


class NgramMod(PerSequenceDrafter):
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
    check_positive(n_match=n_match, n_max=n_max, table_size=table_size, low_rounds=low_rounds)
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
