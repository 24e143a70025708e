"""`ngram_mod` on the device: llama.cpp's hashed n-gram -> next-token table as a fixed-size int32
array updated functionally inside the engine's jitted loop.

Same drafts and reset rules as the host `NgramMod` (see ngram_mod.py; tested against it): one table
shared by all sequences; a sequence's new n-grams are added once more than `add_chunk` tokens are
pending; drafting is a rolling lookup (look up, append, shift) until an empty entry or the budget;
a draft shorter than `n_min` is not offered; the table is reset when more than a quarter of it was
overwritten (checked when a request begins) and after `low_rounds` verified drafts in a row with
acceptance under `low_accept`. Several writes to one entry in one update resolve to the latest
history position, as the sequential host version does.

The table persists across requests by design: `end_device` keeps the final table on the drafter,
and the next request starts from it (`params()` hands it to the jitted loop).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import DeviceDrafter, Draft, DraftContext, RoundResult
from specjax.drafters.ngram_index import EMPTY
from specjax.drafters.ngram_mod import ngram_mod_hash


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NgramModState:
  table: jax.Array            # [S] int32 next token per hashed n-gram (EMPTY = -1)
  n_overwritten: jax.Array    # [] int32 adds into a non-empty entry since the last reset
  i_next: jax.Array           # [B] int32 first n-gram start of the sequence not yet added
  n_draft_last: jax.Array     # [B] int32 length of the sequence's last draft
  n_low: jax.Array            # [B] int32 verified rounds in a row with low acceptance


def _add_ngrams(table, n_overwritten, history, start, stop, n):
  """Write hash(history[s:s+n]) -> history[s+n] for s in [start_b, stop_b) of every row.

  history [B, H]; start, stop [B]. Duplicate indices resolve to the latest (b, s), sequences in
  order, as the host adds them one after another.
  """
  b, h = history.shape
  w = h - n                                                                      # window starts
  windows = jnp.stack([history[:, i:i + w] for i in range(n)], axis=-1)          # [B, W, n]
  idx = ngram_mod_hash(windows, table.shape[0])                                  # [B, W]
  nxt = history[:, n:n + w]                                                      # [B, W]
  s = jnp.arange(w)[None, :]
  valid = (s >= start[:, None]) & (s < stop[:, None])                            # [B, W]
  order = (jnp.arange(b)[:, None] * w + s + 1).astype(jnp.int32)                 # write order, 1-based
  size = table.shape[0]
  flat_idx = jnp.where(valid, idx, size).reshape(-1)                             # size = dropped
  latest = jnp.zeros((size,), jnp.int32).at[flat_idx].max(order.reshape(-1), mode="drop")
  wins = valid & (latest[jnp.minimum(idx, size - 1)] == order)                   # [B, W]
  was_filled = (table[jnp.minimum(idx, size - 1)] != EMPTY) & valid
  n_valid = jnp.sum(valid)
  n_new_entries = jnp.sum(wins & ~was_filled)
  overwritten = jnp.sum(was_filled) + (n_valid - jnp.sum(was_filled)) - n_new_entries
  table = table.at[jnp.where(wins, idx, size).reshape(-1)].set(nxt.reshape(-1), mode="drop")
  return table, n_overwritten + overwritten.astype(jnp.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class NgramModDevice(DeviceDrafter):
  """Device drafter with llama.cpp's ngram_mod defaults (n_match 24, n_min 48, n_max 64, 4M entries).

  Compared by identity (it carries the shared table between requests)."""
  n_match: int = 24
  n_min: int = 48
  n_max: int = 64
  table_size: int = 4 * 1024 * 1024
  add_chunk: int = 32
  low_accept: float = 0.5
  low_rounds: int = 3
  reset_occupancy: float = 0.25
  width: int | None = None                       # verify width K (default n_max)
  name: str = "ngram_mod"
  cross_request_memory: ClassVar[bool] = True
  chunk_commit: ClassVar[bool] = True   # commit reads the verified count and its own last draft length only
  taps: tuple[int, ...] = ()
  _shared: dict = dataclasses.field(default_factory=dict, repr=False)

  def __post_init__(self):
    if not 0 <= self.n_min <= self.n_max or self.n_match < 1 or self.table_size >= 2 ** 31:
      raise ValueError("need 0 <= n_min <= n_max, n_match >= 1, table_size < 2^31")

  @property
  def max_draft(self) -> int:
    return min(self.width or self.n_max, self.n_max)

  @property
  def table(self) -> np.ndarray:
    return np.asarray(self.params()["table"])

  def params(self):
    if "table" not in self._shared:
      self._shared["table"] = jnp.full((self.table_size,), EMPTY, jnp.int32)
      self._shared["n_overwritten"] = jnp.zeros((), jnp.int32)
    return {"table": self._shared["table"], "n_overwritten": self._shared["n_overwritten"]}

  def end_device(self, dstate: NgramModState) -> None:
    """Keep the shared table for the next request (by design the one cross-request memory)."""
    self._shared["table"], self._shared["n_overwritten"] = dstate.table, dstate.n_overwritten

  def init(self, dparams, prompt_tokens, prompt_lens, prefill_taps, capacity):
    b = prompt_tokens.shape[0]
    table, n_over = dparams["table"], dparams["n_overwritten"]
    reset = n_over > jnp.int32(self.reset_occupancy * self.table_size)
    table = jax.lax.cond(reset, lambda t: jnp.full_like(t, EMPTY), lambda t: t, table)
    n_over = jnp.where(reset, 0, n_over)
    stop = jnp.maximum(prompt_lens - self.n_match, 0)
    zeros = jnp.zeros((b,), jnp.int32)
    if prompt_tokens.shape[1] > self.n_match:
      table, n_over = _add_ngrams(table, n_over, prompt_tokens, zeros, stop, self.n_match)
    return NgramModState(table=table, n_overwritten=n_over, i_next=stop.astype(jnp.int32),
                         n_draft_last=zeros, n_low=zeros)

  def _add_pending(self, ds: NgramModState, ctx: DraftContext) -> NgramModState:
    """The sequences' n-grams not yet in the table, added once more than `add_chunk` are pending."""
    n, length = self.n_match, ctx.hist_len
    pending = (ds.i_next + self.add_chunk < length - 1) & (length >= n) & (ctx.n_max > 0)   # as the host
    stop = jnp.where(pending, jnp.maximum(length - n, 0), ds.i_next)
    table, n_over = jax.lax.cond(
        jnp.any(pending), lambda: _add_ngrams(ds.table, ds.n_overwritten, ctx.history, ds.i_next, stop, n),
        lambda: (ds.table, ds.n_overwritten))
    return dataclasses.replace(ds, table=table, n_overwritten=n_over, i_next=jnp.where(pending, stop, ds.i_next))

  def begin_chunk(self, dparams, ds: NgramModState, ctx: DraftContext) -> NgramModState:
    """A plain chunk (adaptive width 0): the table learns the pending n-grams as a round's propose
    would, and no draft is outstanding, so the commit counts no verified round."""
    ds = self._add_pending(ds, ctx)
    return dataclasses.replace(ds, n_draft_last=jnp.zeros_like(ds.n_draft_last))

  def shadow_propose(self, dparams, ds: NgramModState, ctx: DraftContext):
    """A draft compared with a plain chunk's tokens, not verified: as `begin_chunk`, no draft is
    outstanding for the chunk's commit (its low-acceptance count sees verified drafts only)."""
    draft, ds = self.propose(dparams, ds, ctx)
    return draft, dataclasses.replace(ds, n_draft_last=jnp.zeros_like(ds.n_draft_last))

  def propose(self, dparams, ds: NgramModState, ctx: DraftContext):
    n, k = self.n_match, self.max_draft
    length = ctx.hist_len
    ds = self._add_pending(ds, ctx)
    table, n_over, i_next = ds.table, ds.n_overwritten, ds.i_next
    limit = jnp.minimum(jnp.minimum(ctx.n_max, self.n_max), k)                    # [B]
    cols = length[:, None] - n + jnp.arange(n)[None, :]
    key = jnp.take_along_axis(ctx.history, jnp.clip(cols, 0, ctx.history.shape[1] - 1), axis=1)   # [B, n]

    def step(i, c):
      key, tokens, active, count = c
      tok = table[ngram_mod_hash(key, self.table_size)]                          # [B]
      active = active & (tok != EMPTY) & (i < limit)
      tokens = tokens.at[:, i].set(jnp.where(active, tok, 0))
      key = jnp.concatenate([key[:, 1:], tok[:, None]], axis=1)                  # shift in the new token
      return key, tokens, active, count + active.astype(jnp.int32)

    b = length.shape[0]
    init = (key, jnp.zeros((b, k), jnp.int32), length >= n, jnp.zeros((b,), jnp.int32))
    _, tokens, _, lengths = jax.lax.fori_loop(0, k, step, init)
    lengths = jnp.where(lengths >= jnp.minimum(self.n_min, limit), lengths, 0).astype(jnp.int32)
    ds = NgramModState(table=table, n_overwritten=n_over, i_next=i_next, n_draft_last=lengths, n_low=ds.n_low)
    return Draft(tokens=tokens, lengths=lengths), ds

  def commit(self, dparams, ds: NgramModState, result: RoundResult):
    verified = result.live & (ds.n_draft_last > 0)
    low = result.n_accepted < self.low_accept * ds.n_draft_last
    n_low = jnp.where(verified, jnp.where(low, ds.n_low + 1, 0), ds.n_low)
    reset = jnp.any(n_low >= self.low_rounds)
    table = jax.lax.cond(reset, lambda t: jnp.full_like(t, EMPTY), lambda t: t, ds.table)
    return NgramModState(table=table, n_overwritten=jnp.where(reset, 0, ds.n_overwritten),
                         i_next=jnp.where(reset, 0, ds.i_next), n_draft_last=jnp.zeros_like(ds.n_draft_last),
                         n_low=jnp.where(n_low >= self.low_rounds, 0, n_low))
