"""`ngram_simple` on the device: prompt-lookup drafting as array operations inside the engine's
jitted loop, so a round costs no host round trip.

Same drafts as the host `NgramSimple` (tested against it): the key is the last `size_n` tokens of
the history (ending with the newest token); the most recent earlier occurrence that still has at
least `min(size_n, size_m)` known tokens after it is taken, and the draft is the up-to-`size_m`
tokens that followed it. Matching is a vectorised compare over the whole history buffer:
O(B * H * size_n) element operations, a few microseconds on a GPU.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp

from specjax.drafters.base import DeviceDrafter, Draft, DraftContext, RoundResult


def ngram_lookup(history: jax.Array, hist_len: jax.Array, size_n: int, size_m: int, budget: jax.Array,
                 k: int) -> tuple[jax.Array, jax.Array]:
  """history [B, H] int, hist_len [B], budget [B] -> (draft [B, k] int32, lengths [B] int32)."""
  b, h = history.shape
  n_starts = h - size_n + 1
  key_cols = hist_len[:, None] - size_n + jnp.arange(size_n)[None, :]                    # [B, n]
  key = jnp.take_along_axis(history, jnp.clip(key_cols, 0, h - 1), axis=1)              # [B, n]
  match = jnp.ones((b, n_starts), bool)
  for i in range(size_n):                                                                # static, small
    match = match & (history[:, i:i + n_starts] == key[:, i:i + 1])                     # [B, S]
  starts = jnp.arange(n_starts)[None, :]
  min_len = min(size_n, size_m)
  valid = match & (starts + size_n + min_len <= hist_len[:, None]) & (hist_len[:, None] >= size_n)
  best = jnp.max(jnp.where(valid, starts, -1), axis=1)                                  # [B] most recent
  first = best + size_n                                                                  # [B]
  cols = first[:, None] + jnp.arange(k)[None, :]
  draft = jnp.take_along_axis(history, jnp.clip(cols, 0, h - 1), axis=1).astype(jnp.int32)
  avail = hist_len - first
  lengths = jnp.where(best >= 0, jnp.minimum(jnp.minimum(avail, size_m), jnp.minimum(budget, k)), 0)
  return draft, jnp.maximum(lengths, 0).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class NgramSimpleDevice(DeviceDrafter):
  """Device drafter: stateless prompt lookup over the engine's history buffer."""
  size_n: int = 12
  size_m: int = 48
  width: int | None = None          # verify width K (default size_m); set to n_max to verify less
  name: str = "ngram_simple"
  taps: tuple[int, ...] = ()
  commit_free: typing.ClassVar[bool] = True   # commit changes nothing: adaptive width-0 rounds may skip the drafter
  replayable: typing.ClassVar[bool] = True    # point-mass drafts from the history alone (`propose_at`)

  def __post_init__(self):
    if self.size_n < 1 or self.size_m < 1:
      raise ValueError(f"size_n and size_m must be >= 1, got {self.size_n}, {self.size_m}")

  @property
  def max_draft(self) -> int:
    return min(self.width or self.size_m, self.size_m)

  def params(self):
    return ()

  def init(self, dparams, prompt_tokens, prompt_lens, prefill_taps, capacity):
    return jnp.zeros((), jnp.int32)          # stateless

  def propose(self, dparams, dstate, ctx: DraftContext):
    draft, lengths = ngram_lookup(ctx.history, ctx.hist_len, self.size_n, self.size_m, ctx.n_max, self.max_draft)
    return Draft(tokens=draft, lengths=lengths), dstate

  def propose_at(self, history, at):
    """The drafts this drafter would propose at prefix lengths at [B, T] of history [B, H]
    -> (drafts [B, T, K], lengths [B, T]): what adaptive drafting replays (`specjax.engine.adaptive_replay`)."""
    k = self.max_draft
    lookup = lambda n: ngram_lookup(history, n, self.size_n, self.size_m, jnp.full_like(n, k), k)
    return jax.vmap(lookup, in_axes=1, out_axes=(1, 1))(at)

  def commit(self, dparams, dstate, result: RoundResult):
    return dstate
