"""Model state as immutable pytrees: the KV cache with per-sequence lengths.

A KV cache holds, per layer, keys and values for `capacity` slots of every sequence, and one
length per sequence. Slots `[0, length)` are committed; anything past `length` is stale and is
never attended to. Writing T new tokens puts them at slots `length .. length+T-1`; rolling back a
rejected draft is just setting `lengths` lower. A checkpoint is the previous value.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.errors import UserError


class CacheOverflowError(UserError):
  """A sequence would grow past the KV cache's capacity."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  k: tuple[jax.Array, ...]        # per layer [B, S, KVH, D]
  v: tuple[jax.Array, ...]        # per layer [B, S, KVH, D]
  lengths: jax.Array              # [B] int32, committed slots per sequence

  @staticmethod
  def init(cfg, batch: int, capacity: int, dtype=jnp.float32) -> "KVCache":
    shape = (batch, capacity, cfg.n_kv_heads, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
    return KVCache(k=zeros(), v=zeros(), lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def batch(self) -> int:
    return self.lengths.shape[0]

  @property
  def capacity(self) -> int:
    return self.k[0].shape[1]

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    """Roll back (or forward) to `lengths` [B]: the pure form of truncation."""
    return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))

  def write(self, layer: int, k_new: jax.Array, v_new: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys/values of `layer` with `k_new`/`v_new` [B, T, KVH, D] written at slots length+t.

    Batch 1 writes one `dynamic_update_slice` at the row's length: XLA updates the cache in place
    and fuses the write with the new keys' producer (rotary embedding). A start past capacity - T
    is clamped, so a row that outgrew its cache overwrites its own last slots; such a row's output
    is wrong whatever the write does (its new tokens cannot attend to themselves), and concrete
    lengths are refused beforehand (`check_capacity`, `generation.plan_capacity`).
    Larger batches scatter each row's slots (a `jax.vmap` of the one-row update, the batch a
    batching dimension of the scatter), dropping slots past the capacity, so a finished or padded
    row that outgrew its cache leaves the others untouched; with the batch split over the mesh's
    "data" axis every device writes its rows where they are (a scatter naming rows by explicit
    indices would gather every row's keys, values and slots onto every device first). XLA turns the
    dropping scatter into a slice update behind a select of the old slots, a kernel of its own per
    layer that the batch-1 write does without."""
    if k_new.shape[0] == 1:
      at = (0, self.lengths[0], 0, 0)
      return (jax.lax.dynamic_update_slice(self.k[layer], k_new.astype(self.k[layer].dtype), at),
              jax.lax.dynamic_update_slice(self.v[layer], v_new.astype(self.v[layer].dtype), at))
    return scatter_rows(self.k[layer], k_new, self.lengths), scatter_rows(self.v[layer], v_new, self.lengths)


def scatter_rows(cache: jax.Array, new: jax.Array, lengths: jax.Array) -> jax.Array:
  """cache [B, S, KVH, D] with new [B, T, KVH, D] at slots lengths + t of each row, slots past the
  capacity dropped (a `jax.vmap` of the one-row update: the batch is a batching dimension of the
  scatter)."""
  t = new.shape[1]

  def one(rows, new_rows, length):                                               # [S, KVH, D], [T, KVH, D], []
    return rows.at[length + jnp.arange(t, dtype=jnp.int32)].set(new_rows.astype(rows.dtype), mode="drop")
  return jax.vmap(one)(cache, new, lengths)


def check_capacity(lengths, n_new: int, capacity: int) -> None:
  """Raise CacheOverflowError if any concrete length + n_new exceeds capacity (no-op when traced)."""
  if isinstance(lengths, jax.core.Tracer):
    return
  worst = int(jnp.max(lengths)) + n_new
  if worst > capacity:
    raise CacheOverflowError(
        f"a sequence would reach {worst} tokens but the KV cache holds {capacity}; "
        f"raise max_len / cache capacity or shorten the prompt / max_new_tokens")
