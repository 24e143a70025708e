"""A bounded window of per-position target features for each sequence (DFlash's context).

Each sequence keeps the features of at most `W` of its newest committed positions in a ring:
the row of position p lives in slot `p mod W`, next to its position (`pos`, -1 = empty slot). A
new position overwrites the one W positions older, so the window always holds the last W
positions written, whatever the order of rounds; attention reads the slots in any order (every
row carries its own rotary position), so the ring never needs reordering while it only grows.

Three edits keep it right:
- `append`: the rows of `count` [B] new consecutive positions (rows past `count` are ignored; of
  more than W new rows only the last W are kept),
- `trim`: forget positions >= length (a context truncated to `length` tokens),
- `shift`: llama.cpp's context shift: drop positions [keep, keep + discard), move the ones after
  down by `discard` and put every row back at slot `new position mod W`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FeatureWindow:
  feats: jax.Array                # [B, W, D] feature rows, slot p mod W
  pos: jax.Array                  # [B, W] int32 position of each slot's row; -1 = empty

  @staticmethod
  def empty(batch: int, size: int, dim: int, dtype=jnp.float32) -> "FeatureWindow":
    return FeatureWindow(feats=jnp.zeros((batch, size, dim), dtype), pos=jnp.full((batch, size), -1, jnp.int32))

  @property
  def size(self) -> int:
    return self.pos.shape[1]

  @property
  def valid(self) -> jax.Array:
    """[B, W] bool: slots holding a row."""
    return self.pos >= 0

  def append(self, rows: jax.Array, positions: jax.Array, count: jax.Array) -> "FeatureWindow":
    """Write rows [B, T, D] of consecutive positions [B, T]; only the first count [B] per sequence."""
    b, t = positions.shape
    w = self.size
    j = jnp.arange(t, dtype=jnp.int32)[None, :]                                   # [1, T]
    count = jnp.asarray(count, jnp.int32)[:, None]                                # [B, 1]
    keep = (j < count) & (j >= count - w)                                         # [B, T] the last W new rows
    slot = jnp.where(keep, positions % w, w)                                      # [B, T]; w -> dropped
    bi = jnp.arange(b)[:, None]
    feats = self.feats.at[bi, slot].set(rows.astype(self.feats.dtype), mode="drop")
    pos = self.pos.at[bi, slot].set(positions.astype(jnp.int32), mode="drop")
    return FeatureWindow(feats=feats, pos=pos)

  def trim(self, length: jax.Array) -> "FeatureWindow":
    """Forget every position >= length [B]."""
    return dataclasses.replace(self, pos=jnp.where(self.pos >= jnp.asarray(length)[:, None], -1, self.pos))

  def shift(self, keep: jax.Array, discard: jax.Array) -> "FeatureWindow":
    """Context shift per sequence (keep, discard [B]): positions in [keep, keep + discard) are
    dropped, later ones move down by `discard`; rows land in their new slots. The kept positions
    span at most W, so no two of them share a slot."""
    keep, discard = jnp.asarray(keep)[:, None], jnp.asarray(discard)[:, None]
    p = self.pos
    gone = (p >= keep) & (p < keep + discard)
    new_pos = jnp.where(p >= keep + discard, p - discard, p)
    new_pos = jnp.where(gone | (p < 0), -1, new_pos)                             # [B, W]
    w = self.size
    slot = jnp.where(new_pos >= 0, new_pos % w, w)
    bi = jnp.arange(p.shape[0])[:, None]
    fresh = FeatureWindow.empty(p.shape[0], w, self.feats.shape[-1], self.feats.dtype)
    return FeatureWindow(feats=fresh.feats.at[bi, slot].set(self.feats, mode="drop"),
                         pos=fresh.pos.at[bi, slot].set(new_pos, mode="drop"))
