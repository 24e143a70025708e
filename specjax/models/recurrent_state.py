"""State of a hybrid (attention + recurrent) model as one immutable pytree, and its rollback.

`HybridState` holds the KV cache of the attention layers (rolled back by length, as in
`specjax.models.kv_cache`) and, per recurrent layer, a convolution state (the last K-1 conv inputs) and a
recurrent state (the gated-DeltaNet matrix per value head). Recurrent state cannot be rolled back by
a length: after a rejected draft it must be replaced by the state at the accepted position. Two
ways, both here or in `specjax.models.hybrid`:

- `per_step`: verification also returns the state after each of its T positions
  (`HybridState` whose recurrent leaves carry a [B, T, ...] axis); `rollback_per_step` picks the
  one at the accepted length. Restoring costs a gather; memory is T recurrent states.
- `redecode`: keep the recurrent state from before verification (the old value: immutable state
  makes it a checkpoint for free); on partial acceptance run the accepted tokens again from it
  (`specjax.models.hybrid.rollback_redecode`). Memory is one extra state; time is a second pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.models.kv_cache import KVCache

ROLLBACK_MODES = ("per_step", "redecode")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridState:
  kv: KVCache                     # attention layers only: per attention layer [B, S, KVH, D]
  conv: tuple[jax.Array, ...]     # per recurrent layer [B, K-1, C] float32   (per-step: [B, T, K-1, C])
  rec: tuple[jax.Array, ...]      # per recurrent layer [B, Hv, Dk, Dv] float32 (per-step: [B, T, Hv, Dk, Dv])

  @staticmethod
  def init(cfg, batch: int, capacity: int, dtype=jnp.float32) -> "HybridState":
    """Empty state of a `HybridConfig`: zero KV for its attention layers, zero conv / recurrent
    states for its recurrent layers."""
    shape = (batch, capacity, cfg.n_kv_heads, cfg.head_dim)
    n_attn, n_lin = len(cfg.attn_layers), len(cfg.linear_layers)
    kv = KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(n_attn)),
                 v=tuple(jnp.zeros(shape, dtype) for _ in range(n_attn)),
                 lengths=jnp.zeros((batch,), jnp.int32))
    conv = tuple(jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), jnp.float32) for _ in range(n_lin))
    rec = tuple(jnp.zeros((batch, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim), jnp.float32)
                for _ in range(n_lin))
    return HybridState(kv=kv, conv=conv, rec=rec)

  @property
  def lengths(self) -> jax.Array:
    """[B] committed tokens (the KV cache's lengths; the recurrent state has consumed as many)."""
    return self.kv.lengths

  @property
  def batch(self) -> int:
    return self.kv.lengths.shape[0]

  @property
  def capacity(self) -> int:
    return self.kv.k[0].shape[1] if self.kv.k else 0

  def recurrent_nbytes(self) -> int:
    """Bytes of the conv + recurrent leaves (what a checkpoint of the recurrent part costs)."""
    return sum(x.size * x.dtype.itemsize for x in self.conv + self.rec)


def _rows_where(keep: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
  """a where keep [B] else b, row-wise."""
  return jnp.where(keep.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)


def pick_step(per_step: jax.Array, index: jax.Array) -> jax.Array:
  """per_step [B, T, ...] -> [B, ...] at index [B] (clipped to [0, T-1])."""
  idx = jnp.clip(index, 0, per_step.shape[1] - 1).reshape((-1, 1) + (1,) * (per_step.ndim - 2))
  return jnp.take_along_axis(per_step, idx, axis=1)[:, 0]


def rollback_per_step(state_before: HybridState, per_step_states: HybridState, n_keep: jax.Array) -> HybridState:
  """The state after the first n_keep [B] of the T verified tokens.

  state_before: the state verification started from; per_step_states: what `hybrid_forward(...,
  return_per_step=True)` returned (the KV cache after verification, recurrent leaves [B, T, ...]).
  Rows with n_keep = 0 (sequences that were not live) get their old recurrent state back.
  """
  keep = n_keep > 0
  pick = lambda steps, old: _rows_where(keep, pick_step(steps, n_keep - 1).astype(old.dtype), old)
  return HybridState(kv=per_step_states.kv.with_lengths(state_before.lengths + n_keep),
                     conv=tuple(map(pick, per_step_states.conv, state_before.conv)),
                     rec=tuple(map(pick, per_step_states.rec, state_before.rec)))


def select_rows(keep: jax.Array, a: HybridState, b: HybridState) -> HybridState:
  """Row-wise choice between two states of the same shapes (a where keep [B], else b)."""
  return jax.tree_util.tree_map(lambda x, y: _rows_where(keep, x, y), a, b)
