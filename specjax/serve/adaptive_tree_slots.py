"""Adaptive node budgets over the live slot batch for a tree drafter: before every device call, the
node budget of its rounds (0: rounds that verify `last` alone, keeping the drafter's state current),
chosen from what each slot's rounds showed and the measured cost of a round at each budget, so that
a tree is dropped, or shrunk, where it costs throughput.

What a round shows (as in the offline loop, `specjax.engine.adaptive_tree`): a budgeted tree
drafter's tree at budget w is the nodes of rank < w of its tree at any larger budget, so a round at
budget b shows, per slot, the tokens a round at every budget w <= b would have emitted: 1 + the
depths of the accepted path whose largest rank so far is below w (exact for greedy rows, an
estimate for sampled ones). `run_rounds` reports the accepted path's ranks per round; each slot
keeps decayed sums of those tokens and of the rounds that showed them, per budget, and reads them
as tokens per round shrunk toward the batch's pooled figure by `prior_rounds` rounds
(`adaptive.tau_replayed`). A drafter that cannot draft fewer nodes (not `budgeted`) chooses
between 0 and its whole tree.

The rule is the chain controller's (`adaptive_slots`): the budget with the most expected tokens per
millisecond over the live slots, w = argmax_w sum_i live_i tau_i(w) / cost(w), cost(w) the running
cost of this server's rounds at w in the call's batch bucket (`RoundCosts`). Exploration: the first
`explore_rounds` rounds run at the widest budget (which shows every budget); budgets above the
chosen one are shown by shadow trees where budget-0 calls run as plain chunks (each chunk's tree at
the widest budget, walked along the chunk's tokens: `engine.plain_chunks`), otherwise only by
probing: every `explore_every`-th call runs one round at the budget one above the choice, and a
rising acceptance climbs the ladder a budget at a time.
"""

from __future__ import annotations

import numpy as np

from specjax.engine import adaptive as adapt
from specjax.engine.adaptive_tree import accepted_by_budget
from specjax.serve.adaptive_slots import RoundCosts, RoundPlan


class SlotBudgetController(RoundCosts):
  """Node budget and per-slot draft limits for B slots of one tree drafter: `plan` before a call of
  rounds, `observe` after each of its rounds, `join` when a request takes a slot."""

  def __init__(self, ac: adapt.AdaptiveConfig, slots: int, drafter, rounds_per_call: int = 1, shadowed: bool = False):
    """`shadowed`: budget-0 calls report shadow trees (`observe`'s `shadow`), so nothing probes."""
    self.shadowed = shadowed
    k = int(drafter.max_draft)                                              # the tree's node budget
    widths = ac.widths_for(k, tree=True) if drafter.budgeted else (0, k)
    super().__init__(ac, widths)
    self.drafter, self.k, self.rounds_per_call = drafter, k, rounds_per_call
    self.tokens = np.zeros((len(widths), slots))          # [W, B] decayed tokens rounds at each budget would have emitted
    self.rounds = np.zeros((len(widths), slots))          # [W, B] decayed rounds that showed them
    self.round = 0                                        # rounds planned
    self.calls = 0                                        # calls planned after the first exploring stretch
    self._decay = ac.decay ** (1.0 / max(1, ac.segment_rounds))    # per round: the offline loop's decay per segment

  def join(self, slot: int, hist_len: int) -> None:
    """A new request in `slot`: its tallies restart (its estimate is the batch's pooled one)."""
    self.tokens[:, slot] = 0.0
    self.rounds[:, slot] = 0.0

  def tau(self) -> np.ndarray:
    """[W, B] expected tokens per round at each budget, shrunk toward the batch's pooled figure."""
    return adapt.tau_replayed(self.tokens, self.rounds, self.ac.prior_rounds)

  def plan(self, n_max: np.ndarray, n_min: np.ndarray, live: np.ndarray, rounds: int = 1,
           bucket: int | None = None) -> RoundPlan:
    """The plan of the next call of up to `rounds` rounds over `bucket` gathered slots (None: every
    slot). n_max [B] each slot's request limit (a tree's depth cap; 0: speculation off), n_min [B],
    live [B] bool."""
    costs = self.plan_costs(bucket, rounds)
    speculating = live & (n_max > 0) & (n_max >= n_min)
    if self.round < self.ac.explore_rounds:
      wi, rounds = len(self.widths) - 1, min(rounds, self.ac.explore_rounds - self.round)
    else:
      tau = np.where(speculating[None, :], self.tau(), 1.0)                 # a slot not drafting emits 1 per round
      wi = int(np.argmax(np.sum(np.where(live[None, :], tau, 0.0), axis=1) / costs))
      self.calls += 1
      if not self.shadowed and self.calls % self.ac.explore_every == 0 and wi + 1 < len(self.widths):
        wi, rounds = wi + 1, 1                                              # a probe one budget up: one round
    width = self.widths[wi]
    lengths = np.where(speculating & (width > 0), n_max, 0).astype(np.int32)
    self.round += rounds
    return RoundPlan(width=width if lengths.any() else 0, lengths=lengths, rounds=rounds)

  def observe(self, plan: RoundPlan, width: int, drafted, accepted, live, ms: float, history, hist_len,
              bucket: int | None = None, ranks=None, shadow=None) -> None:
    """After a round at budget `width` over `bucket` gathered slots in `ms` milliseconds: live [B]
    (before the round), ranks [B, D] the accepted path's node ranks (`run_rounds`). Every budget up
    to `width` gains, for the slots that drafted, the tokens its tree would have emitted; budget 0
    gains one token for every live slot. A budget-0 round with shadow trees (`shadow` [2, B]: 1
    where a slot's tree was walked, and its accepted depth; `ranks` its path's) shows every budget
    for those slots, as a round at the widest budget would."""
    live = np.asarray(live, bool)
    self.tokens[:, live] *= self._decay
    self.rounds[:, live] *= self._decay
    w = np.asarray(self.widths)
    shadowed = shadow is not None and width == 0 and bool(np.any(np.asarray(shadow[0]) > 0))
    top = self.widths[-1] if shadowed else width
    drafted_here = (np.asarray(shadow[0]) > 0) if shadowed else (np.asarray(plan.lengths) > 0)
    accepted_at = (accepted_by_budget(np.asarray(ranks), self.widths) if ranks is not None and top > 0
                   else np.zeros((len(w), live.shape[0]), np.int64))                        # [W, B]
    shown = (w <= top)[:, None] & live[None, :] & ((w == 0)[:, None] | drafted_here[None, :])
    self.tokens += np.where(shown, 1.0 + accepted_at, 0.0)
    self.rounds += shown
    self.observe_cost(width, ms, bucket)

  def compile(self, history, hist_len) -> None:
    """Nothing to compile (the tallies are host arrays)."""

  def record(self) -> dict:
    """Budgets, their current costs, rounds run at each, and the pooled tokens per round at each."""
    out = self.cost_record()
    out["tau_by_budget"] = [round(float(t), 4) for t in np.mean(self.tau(), axis=1)]
    return out
