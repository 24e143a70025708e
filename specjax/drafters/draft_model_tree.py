"""`draft_tree`: a smaller model with the target's vocabulary drafts a token tree by top-k expansion.

Layout (static): level 1 holds the draft model's top-k tokens after `last`; every deeper level
expands the `width` nodes of the level above with the highest cumulative log-probability, each
into its own top-k tokens. With k = top_k, w = width, D = depth the tree has
k + sum_{d=2..D} min(w, n_{d-1}) * k nodes, in level order (parents before children); `n_nodes` (the
node budget) keeps the first n_nodes of them (still a tree: a parent comes before its children), and
levels past the budget are not drafted.

Candidates are a deterministic function of the context, so the engine verifies them with one-hot
q (`TreeDraft.q = None`), which is lossless at any temperature.

Cache: the draft model's KV cache holds the committed tokens. `propose` first feeds the committed
tokens it lacks (the accepted path and `last`: at most depth + 1, a fixed window with a per-sequence
count), then scores the tree level by level: each level is one forward of all T nodes at tree
positions with the ancestor mask, written past the committed length and never committed (n_new = 0).
`commit` has nothing to do: the next `propose` catches up from the history.

Adaptive drafting asks for smaller budgets (`propose_budget`): the first n nodes of the layout (its
rank is the node index); at budget 0 `propose` only catches up, so the draft cache never falls
behind the bounded catch-up window.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from specjax.drafters.base import DeviceDrafter, DraftContext, RoundResult
from specjax.models.config import ModelConfig
from specjax.models.decoder import forward
from specjax.models.kv_cache import KVCache
from specjax.engine.tree import TreeDraft, empty_draft, tree_shape


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTreeState:
  cache: KVCache              # draft model's KV cache: committed tokens only


def level_sizes(top_k: int, width: int, depth: int) -> tuple[int, ...]:
  """Nodes per level 1..depth."""
  sizes = [top_k]
  for _ in range(1, depth):
    sizes.append(min(width, sizes[-1]) * top_k)
  return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class DraftModelTreeDrafter(DeviceDrafter):
  """Device tree drafter backed by a smaller model. Hashable by its static configuration. A
  sequence's n_max caps the depth verified (`verify_tree`)."""
  chunk_commit: ClassVar[bool] = True   # commit is a no-op; propose catches up from the history (window D+1)
  long_chunks: ClassVar[bool] = False   # so a chunk holds at most D+1 steps
  cfg: ModelConfig
  depth: int = 3
  top_k: int = 2
  width: int = 2
  n_nodes: int | None = None      # node budget: the first n_nodes of the layout (None: all of it)
  weights: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
  name: str = "draft_tree"
  proposes_tree: ClassVar[bool] = True
  budgeted: ClassVar[bool] = True       # adaptive drafting may ask for fewer nodes (`propose_budget`)
  taps: tuple[int, ...] = ()
  kv_on_model: bool = False      # KV caches split over "model" (set by `parallel.place_drafter`)

  def __post_init__(self):
    if self.depth < 1 or self.top_k < 1 or self.width < 1:
      raise ValueError(f"depth, top_k and width must be >= 1, got {self.depth}, {self.top_k}, {self.width}")
    if self.top_k > self.cfg.vocab_size:
      raise ValueError(f"top_k {self.top_k} exceeds the vocabulary ({self.cfg.vocab_size})")
    layout = sum(level_sizes(self.top_k, self.width, self.depth))
    if self.n_nodes is not None and not 1 <= self.n_nodes <= layout:
      raise ValueError(f"node budget n_nodes {self.n_nodes} must be in [1, {layout}], the nodes of depth "
                       f"{self.depth}, top_k {self.top_k}, width {self.width}")

  @property
  def max_draft(self) -> int:          # node budget T
    layout = sum(level_sizes(self.top_k, self.width, self.depth))
    return layout if self.n_nodes is None else self.n_nodes

  @property
  def max_depth(self) -> int:
    return self.depth

  def params(self):
    return self.weights

  def init(self, dparams, prompt_tokens, prompt_lens, prefill_taps, capacity: int) -> DraftTreeState:
    b = prompt_tokens.shape[0]
    cache = KVCache.init(self.cfg, b, capacity, dtype=jax.tree_util.tree_leaves(dparams)[0].dtype)
    _, _, cache = forward(dparams, self.cfg, prompt_tokens, cache, n_new=prompt_lens)
    return DraftTreeState(cache=cache)

  def propose(self, dparams, dstate: DraftTreeState, ctx: DraftContext) -> tuple[TreeDraft, DraftTreeState]:
    return self.propose_budget(dparams, dstate, ctx, self.max_draft)

  def propose_budget(self, dparams, dstate: DraftTreeState, ctx: DraftContext, n_nodes: int):
    """The first `n_nodes` nodes of the layout (levels past them are not drafted); at 0 the catch-up alone."""
    at_last, cache = self._catch_up(dparams, dstate.cache, ctx)
    if n_nodes == 0:
      return empty_draft(ctx.last.shape[0]), DraftTreeState(cache=cache)
    tokens, parents = self._levels(dparams, cache, ctx, at_last, n_nodes)
    n = jnp.where(ctx.n_max > 0, n_nodes, 0).astype(jnp.int32)                    # [B] 0: no drafting
    return TreeDraft(tokens=tokens[:, :n_nodes], parents=parents[:, :n_nodes], n_nodes=n), DraftTreeState(cache=cache)

  def _catch_up(self, dparams, cache: KVCache, ctx: DraftContext):
    """Feed the committed tokens the draft cache lacks: history[Ld .. Lt] (`last` included).
    -> (logits after `last` [B, V], cache)."""
    missing = jnp.maximum(ctx.target_len + 1 - cache.lengths, 0)                    # [B] in 0..depth+1
    window = self.depth + 1
    cols = cache.lengths[:, None] + jnp.arange(window)[None, :]
    feed = jnp.take_along_axis(ctx.history, jnp.minimum(cols, ctx.history.shape[1] - 1), axis=1)   # [B, D+1]
    logits, _, cache = forward(dparams, self.cfg, feed, cache, n_new=missing)       # [B, D+1, V]
    return jnp.take_along_axis(logits, jnp.maximum(missing - 1, 0)[:, None, None], axis=1)[:, 0], cache

  def _levels(self, dparams, cache: KVCache, ctx: DraftContext, at_last, kept: int):
    """The layout's levels while they start within the first `kept` nodes: top-k after `last`, then
    the top-k children of each level's best `width` nodes. -> (tokens [B, T], parents [B, T])."""
    b, k = ctx.last.shape[0], self.top_k
    sizes = level_sizes(k, self.width, self.depth)
    starts = [sum(sizes[:d]) for d in range(self.depth)]
    t = sum(sizes)                                                                  # the whole layout
    logp, tok = jax.lax.top_k(jax.nn.log_softmax(at_last.astype(jnp.float32), axis=-1), k)   # [B, k]
    tokens = jnp.zeros((b, t), jnp.int32).at[:, :k].set(tok)
    parents = jnp.full((b, t), -1, jnp.int32)
    score = jnp.full((b, t), -jnp.inf, jnp.float32).at[:, :k].set(logp)             # cumulative log-prob
    slot_depth = jnp.concatenate([jnp.full((n,), d + 1, jnp.int32) for d, n in enumerate(sizes)])   # [T] static
    positions = ctx.target_len[:, None] + slot_depth[None, :]                       # [B, T]
    for d in range(1, self.depth):
      if starts[d] >= kept:                                                         # past the node budget
        break
      prev, n_prev = starts[d - 1], sizes[d - 1]
      mask = tree_shape(parents, jnp.full((b,), t, jnp.int32)).ancestors            # [B, T, T]
      logits, _, _ = forward(dparams, self.cfg, tokens, cache, positions=positions, n_new=jnp.zeros((b,), jnp.int32),
                             attn_mask=mask)                                        # [B, T, V]
      lp = jax.nn.log_softmax(logits[:, prev:prev + n_prev].astype(jnp.float32), axis=-1)   # [B, n_prev, V]
      n_exp = sizes[d] // k
      best_score, best = jax.lax.top_k(score[:, prev:prev + n_prev], n_exp)         # [B, n_exp] expanded nodes
      child_lp, child_tok = jax.lax.top_k(jnp.take_along_axis(lp, best[:, :, None], axis=1), k)   # [B, n_exp, k]
      start = starts[d]
      tokens = tokens.at[:, start:start + sizes[d]].set(child_tok.reshape(b, -1))
      parents = parents.at[:, start:start + sizes[d]].set(jnp.repeat(prev + best, k, axis=1))
      score = score.at[:, start:start + sizes[d]].set((best_score[:, :, None] + child_lp).reshape(b, -1))
    return tokens, parents

  def commit(self, dparams, dstate: DraftTreeState, result: RoundResult) -> DraftTreeState:
    return dstate     # the cache holds committed tokens only; `propose` catches up from the history
