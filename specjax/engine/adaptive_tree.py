"""Adaptive node budgets for token trees: what every budget would have accepted, read off the ranks
of the accepted path's nodes.

A budgeted tree drafter's tree at budget w is the nodes of rank < w of its tree at any larger budget
b (`TreeDraft.rank`; best-first trees: the best w nodes by score, which lie at most w levels deep;
draft_tree: the first w nodes of its layout). Greedy, the path a budget-w tree would have accepted is
the longest prefix of the budget-b path whose nodes all rank below w: with r_j the largest rank on
the path through depth j, a budget-w round would have emitted 1 + #{j : r_j < w} tokens. So every
round at budget b shows, per sequence, the tokens of a round at each budget w <= b (exactly for
greedy rows; for sampled rows an estimate: a smaller tree tries fewer siblings, so it may accept
another child) and nothing about the budgets above b. `BudgetTally` sums those per budget and
sequence, decayed per segment; the controller reads them as tokens per round shrunk toward the
batch's (`adaptive.tau_replayed`) and picks the budget that finishes the batch soonest
(`adaptive.choose_width_device`), budget 0 being rounds that verify `last` alone.

Exploration: before anything is shown every budget predicts one token per round, so the first
segment runs `explore_rounds` rounds at the widest budget (which shows them all). After it, drafters
caught up in plain chunks at budget 0 start each chunk with a shadow tree at the widest budget,
walked along the tokens the chunk makes (`shadow_path`): every budget is shown once per chunk while
backing off, and no segment explores again. Otherwise the budgets above the chosen one are shown
only by probing: every `explore_every`-th segment runs at the budget one above the controller's
choice, so a rising acceptance climbs the ladder one budget at a time at the price of a few rounds at
a slightly wider tree, never at the widest.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.engine import adaptive as adapt
from specjax.engine.round import Carry, RoundInputs, RoundSpec, Verdict, run_round
from specjax.engine.tree import TreeDraft, path_rank, tree_shape

PAST_PATH = 2 ** 30      # the rank given to depths past the accepted path (never below a budget)


def ranks_on_path(path_rank, n_accepted):
  """[B, D] the accepted path's node ranks (`Verdict.path_rank`), `PAST_PATH` at depths past the
  accepted ones (n_accepted [B])."""
  depth = jnp.arange(path_rank.shape[1])[None, :]
  return jnp.where(depth < n_accepted[:, None], path_rank, PAST_PATH).astype(jnp.int32)


def accepted_by_budget(rank, widths: tuple[int, ...]):
  """[W, B] draft tokens a round at each budget of `widths` would have accepted, from `ranks_on_path`
  [B, D]: the depths whose largest rank so far is below the budget. numpy or jax arrays (the
  server's host controller, the device loop)."""
  xp = adapt._xp(rank)
  if rank.shape[1] == 0:
    return xp.zeros((len(widths), rank.shape[0]), xp.int32)
  reach = xp.maximum.accumulate(rank, axis=1)                                     # [B, D] largest rank through depth j
  return xp.sum(reach[None] < xp.asarray(widths, xp.int32)[:, None, None], axis=2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BudgetTally:
  tokens: jax.Array        # [W, B] f32 tokens rounds at each budget would have emitted (decayed per segment)
  rounds: jax.Array        # [W, B] f32 rounds that showed them

  @staticmethod
  def init(n_widths: int, batch: int) -> "BudgetTally":
    return BudgetTally(tokens=jnp.zeros((n_widths, batch), jnp.float32),
                       rounds=jnp.zeros((n_widths, batch), jnp.float32))

  def observe(self, widths: tuple[int, ...], width: int, verdict: Verdict) -> "BudgetTally":
    """One round at budget `width` (static; widths: the ladder, ascending): every budget w <= width
    gains the tokens its tree would have emitted, for the sequences live this round."""
    w = jnp.asarray(widths, jnp.int32)                                              # [W]
    if verdict.path_rank is None:                                                   # budget 0: no tree
      accepted = jnp.zeros((len(widths),) + verdict.n_accepted.shape, jnp.int32)
    else:
      accepted = accepted_by_budget(ranks_on_path(verdict.path_rank, verdict.n_accepted), widths)   # [W, B]
    shown = (w <= width)[:, None] & verdict.live[None, :]                           # [W, B]
    return BudgetTally(tokens=self.tokens + jnp.where(shown, 1.0 + accepted, 0.0),
                       rounds=self.rounds + shown.astype(jnp.float32))

  def observe_shadow(self, widths: tuple[int, ...], tree: TreeDraft, dp: dict, made, steps, max_depth: int) -> "BudgetTally":
    """A shadow tree at the widest budget, walked along the tokens a plain chunk made (`shadow_path`):
    every budget gains the tokens its tree would have emitted, for the sequences live in the chunk."""
    accepted = accepted_by_budget(shadow_ranks(tree, dp, made, steps, max_depth)[0], widths)   # [W, B]
    shown = jnp.broadcast_to((steps > 0)[None, :], accepted.shape)
    return BudgetTally(tokens=self.tokens + jnp.where(shown, 1.0 + accepted, 0.0),
                       rounds=self.rounds + shown.astype(jnp.float32))

  def observe_plain(self, live_rounds) -> "BudgetTally":
    """Rounds at budget 0 (widths[0]; they verify `last` alone): live_rounds [B] per sequence, each
    showing budget 0 one token."""
    shown = jnp.zeros_like(self.rounds).at[0].set(live_rounds.astype(jnp.float32))   # [W, B]
    return BudgetTally(tokens=self.tokens + shown, rounds=self.rounds + shown)

  def decayed(self, decay: float) -> "BudgetTally":
    return BudgetTally(tokens=decay * self.tokens, rounds=decay * self.rounds)

  def tau(self, prior_rounds: float) -> jax.Array:
    """[W, B] expected tokens per round at each budget (1 before anything is shown)."""
    return adapt.tau_replayed(self.tokens, self.rounds, prior_rounds)

  def pooled(self) -> jax.Array:
    """[W] the batch's tokens per round at each budget (decayed)."""
    return jnp.sum(self.tokens, 1) / jnp.maximum(jnp.sum(self.rounds, 1), 1e-6)


def shadow_path(tree: TreeDraft, dp: dict, made, steps, max_depth: int):
  """The path a round verifying `tree` would have accepted, greedy, when the target's tokens after
  `last` are made [B, m] (the first steps [B] of each row real): from the root, at each depth the
  first valid child (in index order, as acceptance tries them) whose token is the target's.
  Depths past n_max (per sequence) are cut, and a tree shallower than n_min accepts nothing, as in
  `round.verify_tree`. -> (path [B, D] node indices, -1 past it; accepted [B])."""
  b, t = tree.tokens.shape
  shape = tree_shape(tree.parents, tree.n_nodes, max_depth)
  within = shape.valid & (shape.depth <= dp["n_max"][:, None])                     # [B, T]
  reach = jnp.max(jnp.where(within, shape.depth, 0), axis=1, initial=0)
  within = within & (reach >= dp["n_min"])[:, None]
  cur, on = jnp.full((b,), -1, jnp.int32), jnp.ones((b,), bool)
  path = []
  for j in range(max_depth):
    tok = made[:, j] if j < made.shape[1] else jnp.zeros((b,), jnp.int32)
    hit = within & (shape.parents == cur[:, None]) & (tree.tokens == tok[:, None])   # [B, T]
    on = on & jnp.any(hit, axis=1) & (j < steps)
    node = jnp.argmax(hit, axis=1).astype(jnp.int32)                                 # the first matching child
    path.append(jnp.where(on, node, -1))
    cur = jnp.where(on, node, cur)
  path = jnp.stack(path, axis=1) if path else jnp.zeros((b, 0), jnp.int32)         # [B, D]
  return path, jnp.sum(path >= 0, axis=1).astype(jnp.int32)


def shadow_ranks(tree: TreeDraft, dp: dict, made, steps, max_depth: int):
  """(`ranks_on_path` [B, D] of the path `shadow_path` walks, its accepted depth [B]): what a verified
  round's `Verdict.path_rank` and `n_accepted` would have shown."""
  path, n_acc = shadow_path(tree, dp, made, steps, max_depth)
  return ranks_on_path(path_rank(tree, path), n_acc), n_acc


def choose_budget(tally: BudgetTally, live, remaining, costs, segment, ac, shadowed: bool = False):
  """-> (budget index [], rounds []) of the next segment: the budget that finishes the batch soonest,
  except on exploring segments (the first: the widest budget; without shadow trees every
  `explore_every`-th: one above the choice)."""
  n = costs.shape[0]
  best = adapt.choose_width_device(tally.tau(ac.prior_rounds), live, remaining, costs, ac.tie)
  explore = (segment == 0) if shadowed else (segment % ac.explore_every == 0)
  probe = jnp.where(segment == 0, n - 1, jnp.minimum(best + 1, n - 1))
  return (jnp.where(explore, probe, best).astype(jnp.int32),
          jnp.where(explore, ac.explore_rounds, ac.segment_rounds).astype(jnp.int32))


def rounds_tallied(spec: RoundSpec, inp: RoundInputs, rounds, carry: Carry, tally: BudgetTally,
                   widths: tuple[int, ...]) -> tuple[Carry, BudgetTally, jax.Array]:
  """Up to `rounds` (traced) rounds at the tree budget `spec.width` (static), each one added to the
  tally. -> (carry, tally, rounds run)."""
  def body(c):
    carry, tally, ran = c
    carry, verdict = run_round(spec, inp, carry)
    return carry, tally.observe(widths, spec.width, verdict), ran + 1
  return jax.lax.while_loop(lambda c: ~jnp.all(c[0].state.done) & (c[2] < rounds), body,
                            (carry, tally, jnp.int32(0)))
