"""The drafter contract. The engine knows nothing of any one drafter beyond this file.

Two kinds:
- `DeviceDrafter`: pure functions over a pytree state, run inside the engine's jitted
  `lax.while_loop` (draft model, MTP, EAGLE-3, DFlash, ngram_mod).
- `HostDrafter`: Python objects over token lists (n-gram maps, suffix trees); the engine runs a
  host loop around one jitted verify-and-accept step.

Both produce a `Draft` (tree drafters a `TreeDraft`); verification is the same code for both.
Capabilities are declared as class attributes of `Drafter` and read by the engine as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import numpy as np

from specjax.errors import UserError

PLAIN_CHUNK_STEPS = 32    # plain decoding steps per catch-up of a `long_chunks` drafter (`engine.plain_chunks`)


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
  n_max: jax.Array                  # [B] per-sequence longest draft (chains: tokens, <= drafter.max_draft;
                                    # trees: the deepest node verified); 0 once done
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


class Drafter:
  """What every drafter declares (class attributes) instead of the engine probing for methods.

  on_device: a `DeviceDrafter` (runs inside the jitted loop) or a `HostDrafter` (Python, between
    jitted verification steps).
  proposes_tree: `propose` returns a `specjax.engine.tree.TreeDraft` (verified in one pass with an ancestor
    mask) instead of a chain `Draft`.
  commit_free: `commit` changes nothing, so adaptive drafting may run rounds without the drafter.
  replayable: `propose_at(history, at)` drafts from the history alone, so adaptive drafting can
    replay what each width would have accepted.
  budgeted: a tree drafter whose `propose_budget(.., n_nodes)` drafts its best n_nodes nodes (the
    nodes of rank < n_nodes of its full tree), so adaptive drafting can choose the node budget.
  chunk_commit: `commit` writes its state from the verified tokens and the target's taps only, never
    from its own drafts, so a stretch of plain decoding steps can be committed as one round whose
    draft was those tokens, all accepted (`specjax.engine.plain_chunks`: adaptive width 0).
  long_chunks: (`chunk_commit` drafters) a chunk's commit may take `PLAIN_CHUNK_STEPS` tokens, more
    than a round verifies, so the drafter is caught up less often (its caches hold that many
    slots beyond the engine's capacity); off for drafters whose next propose catches up a bounded
    window of new tokens.
  cross_request_memory: state outlives a request by design (a shared table, a global suffix tree);
    the bench harness snapshots it so repeats measure the same drafter.
  """
  name: ClassVar[str] = "drafter"
  on_device: ClassVar[bool] = False
  proposes_tree: ClassVar[bool] = False
  commit_free: ClassVar[bool] = False
  replayable: ClassVar[bool] = False
  budgeted: ClassVar[bool] = False
  chunk_commit: ClassVar[bool] = False
  long_chunks: ClassVar[bool] = True
  cross_request_memory: ClassVar[bool] = False
  max_draft: int                    # static K: draft arrays are [B, K] (trees: the node budget `n_nodes`)


class DeviceDrafter(Drafter):
  """Pure functions over a pytree drafter state, traced into the engine's loop; the drafter object
  itself is static (hashable) configuration."""
  on_device: ClassVar[bool] = True
  taps: tuple[int, ...] = ()        # target layers whose hidden states it reads
  # its KV caches split by KV heads over the mesh's "model" axis (its attention weights are, by
  # `parallel.place_drafter`); a field of the drafters that can be split, so that the loops'
  # programs, which constrain the drafter state's layout by it, differ with it
  kv_on_model: bool = False

  def params(self) -> Any:
    """The arrays it drafts with (a pytree passed into the jitted loop)."""
    raise NotImplementedError

  def init(self, dparams, prompt_tokens, prompt_lens, prefill_taps, capacity: int) -> Any:
    """The drafter state after the target's prefill."""
    raise NotImplementedError

  def propose(self, dparams, dstate, ctx: DraftContext) -> tuple[Draft, Any]:
    raise NotImplementedError

  def commit(self, dparams, dstate, result: RoundResult) -> Any:
    """The state after verification (`result` says what was accepted)."""
    raise NotImplementedError

  def propose_at(self, history, at):
    """Replayable drafters: the draft after `history[:at]`, from the history alone."""
    raise NotImplementedError(f"{self.name} is not replayable")

  def propose_budget(self, dparams, dstate, ctx: DraftContext, n_nodes: int):
    """Budgeted tree drafters: the tree of its best `n_nodes` (static, <= max_draft) nodes, with
    their ranks (`TreeDraft.rank`); at 0 an empty chain `Draft` [B, 0], after only what `commit`
    needs (adaptive drafting backs off to rounds that verify `last` alone)."""
    raise NotImplementedError(f"{self.name} has no node budget to choose")

  def begin_chunk(self, dparams, dstate, ctx: DraftContext) -> Any:
    """`chunk_commit` drafters: the state a round's propose leaves for its commit, without the
    draft (the start of a plain chunk, `specjax.engine.plain_chunks`). Here: a budget-0 tree, or
    the whole chain proposed and dropped; drafters whose commit needs less override it."""
    if self.proposes_tree:
      return self.propose_budget(dparams, dstate, ctx, 0)[1]
    return self.propose(dparams, dstate, ctx)[1]

  def shadow_propose(self, dparams, dstate, ctx: DraftContext) -> tuple[Draft, Any]:
    """`chunk_commit` chain drafters: the start of a plain chunk that also drafts. The draft is never
    verified: adaptive drafting compares it with the tokens the chunk makes (a shadow draft), so its
    acceptance estimate learns while it backs off. -> (the draft, the state `begin_chunk` would leave
    for the chunk's commit). Here: `propose`, whose state is that for drafters whose commit reads the
    verified tokens and taps only (the chunk's commit overwrites the draft's entries); a drafter
    whose commit reads its own last draft overrides it."""
    return self.propose(dparams, dstate, ctx)

  def end_device(self, dstate) -> None:
    """After a request: keep what outlives it (drafters with cross-request memory). No-op here."""


class HostDrafter(Drafter):
  """A Python object over token lists, called once per round by the engine's host loop."""
  on_device: ClassVar[bool] = False

  def begin(self, prompts: list[list[int]]) -> None:
    raise NotImplementedError

  def propose(self, histories: list[list[int]], n_max: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """-> (tokens [B, K] int32, lengths [B], score [B] expected accepted tokens, or None)."""
    raise NotImplementedError

  def accept(self, n_accepted: np.ndarray, verified: np.ndarray | None = None) -> None:
    """Accepted draft tokens per sequence; `verified` [B] bool says whose draft was verified at all
    (False: cut by n_min, or another chain member's draft won). None = all."""
    raise NotImplementedError

  def end(self, histories: list[list[int]]) -> None:
    """After a request, with the final token histories. No-op here."""


def check_drafter(drafter) -> Drafter:
  """`drafter` if it is a DeviceDrafter or a HostDrafter, else a UserError that says so."""
  if not isinstance(drafter, (DeviceDrafter, HostDrafter)):
    raise UserError(f"a drafter must subclass specjax.drafters.base.DeviceDrafter or HostDrafter; "
                    f"got {type(drafter).__name__}")
  return drafter


@dataclasses.dataclass(frozen=True)
class DraftParams:
  """Per-sequence draft parameters as llama.cpp names them; scalars or per-sequence lists.

  n_max: the longest draft (a tree: the depth of its deepest verified node; its node budget is the
  tree speculator's `n_nodes` option); n_min: shorter drafts (shallower trees) are not verified;
  p_min: model drafters stop before a token they are less sure of."""
  n_max: Any = 8
  n_min: Any = 0
  p_min: Any = 0.0

  def arrays(self, batch: int, max_draft: int | None) -> dict[str, np.ndarray]:
    """The per-sequence arrays [B]; n_max checked against the drafter's `max_draft` (None: no bound,
    for trees, where an n_max past the tree's depth cuts nothing)."""
    arr = lambda x, dt: np.broadcast_to(np.asarray(x, dt), (batch,)).copy()
    n_max, n_min, p_min = arr(self.n_max, np.int32), arr(self.n_min, np.int32), arr(self.p_min, np.float32)
    if (n_max < 0).any():
      raise UserError(f"n_max must be >= 0 (0 = no drafting), got {n_max}")
    if max_draft is not None and (n_max > max_draft).any():
      raise UserError(f"n_max must be at most {max_draft} for this drafter, got {n_max}")
    if (n_min < 0).any() or (n_min > n_max).any():
      raise UserError(f"n_min must be in [0, n_max], got n_min={n_min}, n_max={n_max}")
    if not ((p_min >= 0) & (p_min <= 1)).all():
      raise UserError(f"p_min must be in [0, 1], got {p_min}")
    return {"n_max": n_max, "n_min": n_min, "p_min": p_min}
