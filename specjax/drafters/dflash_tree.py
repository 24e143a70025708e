"""`dflash_tree`: one DFlash pass drafts a token tree instead of a chain.

A DFlash pass (`specjax/drafters/dflash.py`) gives, for the next `depth` tokens, distributions
q_1 .. q_depth that all read only the committed context: independent per-position marginals. The
tree spends a node budget on the likeliest continuations under their product, EAGLE-2's best-first
way (`Eagle3TreeDrafter.propose_tree`, without model steps: every node's children come from the
same marginal of the next position):

  level 1       the top_k tokens of q_1;
  level l > 1   the frontier (the top_k best paths of level l-1) x the top_k tokens of q_l,
                scored by the path's summed log-probability;

then the best `n_nodes` nodes of all levels (the node budget, the drafter's `max_draft`). Scores
only fall along a path and a parent sits before its children in the pool (ties go to the lower
index), so the chosen nodes are closed under taking prefixes: a tree. Nodes are put in topological
order and their parents remapped.

The candidates are a function of the context only (no sampling), so they go to verification with
q = None (one-hot): lossless for greedy and for sampled targets (`specjax/engine/tree.py`). `commit` is
DFlash's: the engine hands back the target's taps along [last, accepted path...], the committed
positions base .. base + n_accepted, exactly what a chain's accepted prefix gives.

Adaptive drafting asks for smaller budgets (`propose_budget`): the best n nodes lie at most n levels
deep, so a budget-n tree reads min(depth, n) positions and is the nodes of rank < n of the full
tree; at budget 0 there is no DFlash pass at all (the window is filled by `commit`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.base import DraftContext
from specjax.drafters.dflash import DFlashDrafter, DFlashState, drafter_for_target
from specjax.engine.sampling import split_keys
from specjax.engine.tree import TreeDraft, best_nodes, empty_draft, n_candidates, node_budget, score_rank


def best_first_tree(level_logprobs: jax.Array, top_k: int, budget: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Best-first tree over independent per-position log-probabilities [B, D, V] (position l = the
  token at depth l). Returns (tokens [B, T], parents [B, T] (-1 = child of the root), scores [B, T]
  summed log-probabilities) of the best T = `budget` pool nodes, in topological order."""
  b, depth, _ = level_logprobs.shape
  kk = top_k
  tok_score, tok_id = jax.lax.top_k(level_logprobs, kk)                             # [B, D, k] per position
  f_score = tok_score[:, 0]                                                         # [B, k] frontier: level 1
  f_pool = jnp.broadcast_to(jnp.arange(kk, dtype=jnp.int32)[None], (b, kk))        # its nodes' pool indices
  pool_tok, pool_score, pool_parent = [tok_id[:, 0]], [f_score], [jnp.full((b, kk), -1, jnp.int32)]
  offset = kk
  for lvl in range(1, depth):
    c_score = (f_score[:, :, None] + tok_score[:, lvl][:, None, :]).reshape(b, kk * kk)   # [B, k*k]: f * k + j
    pool_tok.append(jnp.tile(tok_id[:, lvl], (1, kk)))                              # [B, k*k] child j's token
    pool_score.append(c_score)
    pool_parent.append(jnp.repeat(f_pool, kk, axis=1))                              # [B, k*k] frontier node f
    if lvl < depth - 1:
      f_score, pick = jax.lax.top_k(c_score, kk)                                    # [B, k] next frontier
      f_pool = offset + pick
    offset += kk * kk
  pool_tok, pool_score, pool_parent = (jnp.concatenate(x, axis=1) for x in (pool_tok, pool_score, pool_parent))
  tokens, parents, scores = best_nodes(pool_tok, pool_score, pool_parent, budget)  # [B, T] x3
  return tokens.astype(jnp.int32), parents, scores


@dataclasses.dataclass(frozen=True)
class DFlashTreeDrafter(DFlashDrafter):
  """A DFlash drafter whose pass drafts a best-first tree: `depth` levels (<= block_size - 1),
  `top_k` children per expanded node, the best `max_draft` candidates (the node budget, the
  speculator's `n_nodes` option). A sequence's n_max caps the depth verified (`verify_tree`); p_min
  is not used."""
  max_draft: int = 32             # node budget
  depth: int = 8
  top_k: int = 8
  name: str = "dflash_tree"
  proposes_tree = True            # class attributes: the engine verifies a TreeDraft,
  budgeted = True                 # and adaptive drafting may ask for fewer nodes (`propose_budget`)

  def __post_init__(self):
    if not 1 <= self.depth <= self.dc.block_size - 1:
      raise ValueError(f"depth {self.depth} must be in [1, block_size - 1 = {self.dc.block_size - 1}]: one pass "
                       f"drafts block_size - 1 positions (lower depth or raise block_size)")
    if not 1 <= self.top_k <= self.cfg.vocab_size:
      raise ValueError(f"top_k must be in [1, vocab size {self.cfg.vocab_size}], got {self.top_k}")
    if not 1 <= self.max_draft <= n_candidates(self.depth, self.top_k):
      raise ValueError(f"node budget n_nodes {self.max_draft} must be in [1, {n_candidates(self.depth, self.top_k)}], "
                       f"the candidates of depth {self.depth}, top_k {self.top_k} (top_k + (depth - 1) * top_k^2)")

  @property
  def max_depth(self) -> int:
    """Deepest node of a tree (the engine's accepted paths are [B, max_depth] wide)."""
    return self.depth

  def propose(self, dparams, dstate: DFlashState, ctx: DraftContext) -> tuple[TreeDraft, DFlashState]:
    return self.propose_budget(dparams, dstate, ctx, self.max_draft)

  def propose_budget(self, dparams, dstate: DFlashState, ctx: DraftContext, n_nodes: int):
    """The tree of the best `n_nodes` nodes over min(depth, n_nodes) positions, ranked by score; at 0
    no pass."""
    keys, _ = split_keys(dstate.keys)                                               # the sampler stream moves as the chain's
    state = dataclasses.replace(dstate, keys=keys, base=ctx.target_len)
    if n_nodes == 0:
      return empty_draft(ctx.last.shape[0]), state
    depth = min(self.depth, n_nodes)
    logits = self.logits(dparams, dstate, ctx.last, ctx.target_len, n_positions=depth)   # [B, D, V]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)                 # [B, D, V]
    tokens, parents, scores = best_first_tree(logp, self.top_k, n_nodes)            # [B, T] x3
    n = jnp.where(ctx.n_max > 0, n_nodes, 0).astype(jnp.int32)                      # [B] 0: no drafting
    return TreeDraft(tokens=tokens, parents=parents, n_nodes=n, rank=score_rank(scores)), state


def make_dflash_tree_drafter(target, head, draft_params=None, *, depth: int = 8, top_k: int = 8,
                             n_nodes: int | None = None, block_size: int | None = None, window: int | None = None,
                             seed: int = 0) -> DFlashTreeDrafter:
  """The `dflash_tree` speculator for a loaded target and a trained DFlash drafter (path, or
  (params, config)). Node budget `n_nodes` (default min(32, the candidates)); `draft_params`' n_max
  caps the depth per sequence at verification, not the budget; `block_size` and `window` override
  the trained ones."""
  dparams, dc = drafter_for_target(target, head, block_size=block_size, window=window)
  return DFlashTreeDrafter(cfg=target.logical_cfg, dc=dc, max_draft=node_budget(n_nodes, depth, top_k), depth=depth,
                           top_k=top_k, seed=seed, weights={"dflash": dparams, "target": target.params})
