"""The drafter contract. The engine knows nothing of any one drafter beyond this file.

Two kinds:
- `DeviceDrafter`: pure functions over a pytree state, run inside the engine's jitted
  `lax.while_loop` (draft model, MTP, EAGLE-3, DFlash, ngram_mod).
- `HostDrafter`: Python objects over token lists (n-gram maps, suffix trees); the engine runs a
  host loop around one jitted verify-and-accept step.

Both produce a `Draft`; verification is the same code for both.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import numpy as np

from specjax.errors import UserError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Draft:
  tokens: jax.Array                 # [B, K] int32 draft tokens after `last`
  lengths: jax.Array                # [B] int32 valid draft tokens (<= n_max)
  q: jax.Array | None = None        # [B, K, V] draft distributions; None = deterministic (one-hot)
  score: jax.Array | None = None    # [B] float32 expected accepted tokens, for chains


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftContext:
  """What a device drafter may read when proposing."""
  last: jax.Array                   # [B] newest token (not yet in the target cache)
  history: jax.Array                # [B, H] prompt + generated tokens
  hist_len: jax.Array               # [B]
  target_len: jax.Array             # [B] committed target cache length (= position of `last`)
  n_max: jax.Array                  # [B] per-sequence draft budget (<= drafter.max_draft; 0 once done)
  p_min: jax.Array                  # [B] per-sequence confidence floor for model drafters
  temperature: jax.Array            # [B] sampling temperature of the sequence


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundResult:
  """What the engine tells a device drafter after verification."""
  n_accepted: jax.Array             # [B] accepted draft tokens
  next_token: jax.Array             # [B] the token sampled after them (the new `last`)
  verified: jax.Array               # [B, K+1] tokens the target scored: [last, d1..dK]
  prenorm: jax.Array                # [B, K+1, d_model] target hidden before final norm at those tokens
  layer_taps: tuple                 # per tapped layer [B, K+1, d_model]
  live: jax.Array                   # [B] bool: sequence was live this round


class DeviceDrafter(Protocol):
  name: str
  on_device: bool                   # True
  max_draft: int                    # static K: draft arrays are [B, K]
  taps: tuple[int, ...]             # target layers whose hidden states it needs

  def params(self) -> Any: ...
  def init(self, dparams, prompt_tokens, prompt_lens, prefill_taps, capacity: int) -> Any: ...
  def propose(self, dparams, dstate, ctx: DraftContext) -> tuple[Draft, Any]: ...
  def commit(self, dparams, dstate, result: RoundResult) -> Any: ...


class HostDrafter(Protocol):
  name: str
  on_device: bool                   # False
  max_draft: int

  def begin(self, prompts: list[list[int]]) -> None: ...
  def propose(self, histories: list[list[int]], n_max: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """-> (tokens [B, K] int32, lengths [B], score [B] or None)."""
  def accept(self, n_accepted: np.ndarray) -> None: ...


@dataclasses.dataclass(frozen=True)
class DraftParams:
  """Per-sequence draft parameters as llama.cpp names them; scalars or per-sequence lists."""
  n_max: Any = 8
  n_min: Any = 0
  p_min: Any = 0.0

  def arrays(self, batch: int, max_draft: int) -> dict[str, np.ndarray]:
    arr = lambda x, dt: np.broadcast_to(np.asarray(x, dt), (batch,)).copy()
    n_max, n_min, p_min = arr(self.n_max, np.int32), arr(self.n_min, np.int32), arr(self.p_min, np.float32)
    if (n_max < 0).any():
      raise UserError(f"n_max must be >= 0 (0 = no drafting), got {n_max}")
    if (n_max > max_draft).any():
      raise UserError(f"n_max must be at most {max_draft} for this drafter, got {n_max}")
    if (n_min < 0).any() or (n_min > n_max).any():
      raise UserError(f"n_min must be in [0, n_max], got n_min={n_min}, n_max={n_max}")
    if not ((p_min >= 0) & (p_min <= 1)).all():
      raise UserError(f"p_min must be in [0, 1], got {p_min}")
    return {"n_max": n_max, "n_min": n_min, "p_min": p_min}
