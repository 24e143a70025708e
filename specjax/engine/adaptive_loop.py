"""Adaptive drafting on the device: one jitted program, a `lax.while_loop` over segments of rounds.

Before each segment the controller picks the verification width that finishes the batch soonest
(`adaptive.choose_width_device`) from the measured round cost of every width and the expected
tokens per round of every sequence, and runs up to `ac.segment_rounds` rounds at that width. The
body holds one bounded loop per width (`loops.rounds_at`) and every one but the chosen runs zero
rounds: a `lax.switch` over the widths ran rounds markedly slower than the fixed loop at batch 1.
No host round trip between segments.

Expected tokens per round come from replaying the produced stream (`adaptive_replay`) for
replayable point-mass drafters (every width, plain decoding included, is evaluated on every
segment, so nothing needs exploring); for tree drafters the width is the node budget and every
round tallies what each smaller budget would have accepted (`adaptive_tree`); otherwise from the
censored-geometric acceptance per sequence, which chain drafters caught up in plain chunks keep
learning at width 0 from shadow drafts (`plain_chunks.shadow_outcome`: one full-width draft per
chunk compared with the chunk's tokens), so nothing explores (the first, short segment runs the
width the prior acceptance chooses); drafters without shadow drafts start with a short segment at
the widest width and refresh it by another every `ac.explore_every` segments (trees with shadow
trees: the first only).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.engine import adaptive as adapt
from specjax.engine import plain_chunks
from specjax.engine.adaptive_replay import ReplayState, replay_segment
from specjax.engine.adaptive_tree import BudgetTally, choose_budget, rounds_tallied
from specjax.engine.loops import device_loop, rounds_at
from specjax.engine.round import Carry, RoundInputs, RoundSpec
from specjax.engine.tree import max_depth_of
from specjax.errors import UserError

ADAPTIVE_LOG = 512      # segments whose [width, rounds] are recorded for the run's report


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Control:
  """What the device controller carries between segments."""
  replay: ReplayState      # replayed acceptance per width (replayable drafters)
  acceptance: adapt.AdaptiveState   # censored-geometric acceptance per sequence (other drafters)
  budgets: BudgetTally     # tokens per round each node budget would have given (tree drafters)
  shadow: jax.Array        # [2] f32 shadow drafts' accepted tokens and rejections, totals (for the report)
  segment: jax.Array       # [] int32 segments run (a backing-off segment counts as the segments it stands for)
  streak: jax.Array        # [] int32 segments in a row that backed off (width 0)
  total: jax.Array         # [] int32 rounds run
  log_width: jax.Array     # [L] int32 width index of each segment (the last slot collects the rest)
  log_rounds: jax.Array    # [L] int32 rounds of each segment

  @staticmethod
  def init(carry: Carry, ac, n_widths: int) -> "Control":
    z = jnp.zeros((ADAPTIVE_LOG,), jnp.int32)
    b = carry.state.last.shape[0]
    return Control(replay=ReplayState.init(carry.state.hist_len, n_widths), acceptance=adapt.AdaptiveState.init(b, ac),
                   budgets=BudgetTally.init(n_widths, b), shadow=jnp.zeros((2,), jnp.float32), segment=jnp.int32(0), streak=jnp.int32(0), total=jnp.int32(0), log_width=z,
                   log_rounds=z)


def shadowed(spec: RoundSpec, ac) -> bool:
  """The loop's width-0 segments draft shadow drafts (drafters caught up in plain chunks whose
  acceptance is not replayed: chains and budgeted trees), and its estimates learn from them."""
  return (ac.shadow_drafts and not spec.drafter.replayable
          and plain_chunks.supports(dataclasses.replace(spec, width=0)))


def timing_key(spec: RoundSpec, params, batch: int, capacity: int, ac) -> tuple:
  """What the device loop's timed round costs are cached under (`adapt.cost_key`): the shape, the
  width ladder, the drafter, and whether width-0 rounds carry shadow drafts (a draft per chunk)."""
  return adapt.cost_key(params, spec.cfg, batch, capacity, widths_of(spec, ac),
                        drafter=(spec.drafter, shadowed(spec, ac)))


def widths_of(spec: RoundSpec, ac, keep=None) -> tuple[int, ...]:
  """The widths (trees: node budgets) the loop chooses from, or those of them at indices `keep`."""
  widths = ac.widths_for(spec.drafter.max_draft, tree=spec.proposes_tree)
  return widths if keep is None else tuple(widths[i] for i in keep)


def _choose(spec, ac, carry: Carry, ctl: Control, inp: RoundInputs, costs, widths, force, max_rounds):
  """-> (width index [], rounds [], segments the segment stands for []) of the next segment.

  Backing off (width 0 chosen) runs several segments' rounds as one: every segment costs the
  controller's work and the entry into each width's loop beside its rounds, and at width 0 there
  is little to learn. Drafters whose estimates rounds at width 0 cannot change (those without
  shadow drafts) run up to their next exploring segment; replayed drafters and drafters with
  shadow drafts, which learn at width 0 too, one segment for the first two back-offs in a row, then
  twice as many as the last, up to `ac.backoff_segments` (replayed: and K + 1, the replay window
  covers that many segments' tokens)."""
  live = ~carry.state.done
  remaining = jnp.maximum(inp.max_new - carry.state.n_out, 1)
  to_explore = ac.explore_every - ctl.segment % ac.explore_every              # segments up to the next exploring one
  explore = ctl.segment % ac.explore_every == 0         # the first segment, then every explore_every-th
  learning_span = jnp.minimum(jnp.left_shift(1, jnp.clip(ctl.streak - 1, 0, 16)), ac.backoff_segments)
  if spec.drafter.replayable:
    tau = adapt.tau_replayed(ctl.replay.tokens, ctl.replay.rounds, ac.prior_rounds)
    rounds = jnp.where(ctl.segment == 0, max(ac.segment_rounds // 2, 1), ac.segment_rounds).astype(jnp.int32)
    wi = adapt.choose_width_device(tau, live, remaining, costs, ac.tie)   # nothing replayed yet: the cheapest
    span = jnp.minimum(learning_span, spec.drafter.max_draft + 1)
    explore = ctl.segment == 0                          # replayed drafters explore nothing; the first segment is short
  elif spec.proposes_tree:
    wi, rounds = choose_budget(ctl.budgets, live, remaining, costs, ctl.segment, ac, shadowed(spec, ac))
    explore = ctl.segment == 0 if shadowed(spec, ac) else explore
    span = learning_span if shadowed(spec, ac) else to_explore
  else:
    # an exploring segment informs the choices after it: none once every live sequence would be done
    # within a segment after it (it would cost its wide rounds and change at most one segment), and
    # none after the first where width-0 segments learn from shadow drafts
    explore = explore & ((ctl.segment == 0) |
                         (jnp.max(jnp.where(live, remaining, 0)) > ac.explore_rounds + ac.segment_rounds))
    span = to_explore
    rounds = jnp.where(explore, ac.explore_rounds, ac.segment_rounds).astype(jnp.int32)
    if shadowed(spec, ac):
      # nothing explores: the first segment runs the prior's choice (drafting where a round costs little
      # more than a plain step, plain decoding where it costs much more) for as long as an exploring one
      explore, span = jnp.bool_(False), learning_span
      rounds = jnp.where(ctl.segment == 0, ac.explore_rounds, ac.segment_rounds).astype(jnp.int32)
    tau = adapt.tau_geometric(ctl.acceptance.alpha, widths)
    wi = jnp.where(explore, len(widths) - 1, adapt.choose_width_device(tau, live, remaining, costs, ac.tie))
  backoff = (widths[0] == 0) & (wi == 0) & ~explore
  span = jnp.where(backoff, jnp.maximum(span, 1), 1).astype(jnp.int32)
  rounds = rounds * span
  wi = jnp.where(force >= 0, force, wi).astype(jnp.int32)
  span = jnp.where(force >= 0, 1, span)
  rounds = jnp.minimum(jnp.where(force >= 0, max_rounds, rounds), max_rounds - ctl.total)
  return wi, rounds, span


def _learn(spec, ac, before: Carry, after: Carry, ctl: Control, widths, wi, ran, span, n_max, seen) -> Control:
  """The controller after a segment standing for `span` segments: replayed acceptance, or the
  acceptance totals (trees: tallied round by round, `_segment`; a width-0 segment's shadow drafts
  `seen` = (accepted [B], rejected [B]) count as verified drafts), and the log. For the totals a
  round that drafted nothing where a draft was asked for (no n-gram match, a draft under n_min)
  counts as a rejection at its first position: such a sequence gains one token a round at any
  width, which its acceptance of the drafts it did make would overstate."""
  replay, acceptance = ctl.replay, ctl.acceptance
  if spec.drafter.replayable:
    k = spec.drafter.max_draft
    window = ac.segment_rounds * (k + 1) + k + 1
    replay = replay_segment(ctl.replay, spec.drafter.propose_at, after.state.history, after.state.hist_len,
                            widths, k, window, ac.decay)
  elif not spec.proposes_tree:
    delta = lambda f: getattr(after.stats, f) - getattr(before.stats, f)
    asked = (jnp.asarray(widths, jnp.int32)[wi] > 0) & (n_max > 0)                 # [B]
    empty = jnp.where(asked, delta("rounds") - delta("gen_drafts"), 0)
    acceptance = adapt.update_totals(ctl.acceptance, delta("acc_tokens") + seen[0], delta("rejected") + empty + seen[1],
                                     ac.decay)
  slot = jnp.minimum(ctl.segment, ADAPTIVE_LOG - 1)
  streak = jnp.where(jnp.asarray(widths, jnp.int32)[wi] == 0, ctl.streak + 1, 0)
  shadow = ctl.shadow + jnp.stack([jnp.sum(seen[0]), jnp.sum(seen[1])]).astype(jnp.float32)
  return dataclasses.replace(ctl, replay=replay, acceptance=acceptance, shadow=shadow, segment=ctl.segment + span,
                             streak=streak,
                             total=ctl.total + ran, log_width=ctl.log_width.at[slot].set(wi),
                             log_rounds=ctl.log_rounds.at[slot].add(ran))


def _segment(specs, ac, inp: RoundInputs, carry: Carry, ctl: Control, widths, wi, rounds):
  """The segment's rounds at width index `wi`: one bounded loop per width, all but the chosen running
  0 rounds; tree rounds add to the budget tally (decayed once per segment).
  -> (carry, ctl, ran, the shadow drafts' (accepted [B], rejected [B]))."""
  budgets, ran = (ctl.budgets.decayed(ac.decay) if specs[0].proposes_tree else ctl.budgets), jnp.int32(0)
  b = carry.state.last.shape[0]
  seen = (jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32))
  for i, spec_w in enumerate(specs):
    n_i = jnp.where(wi == i, rounds, 0)
    if plain_chunks.supports(spec_w):      # width 0: plain decoding steps, the drafter caught up per chunk
      if shadowed(spec_w, ac) and spec_w.proposes_tree:
        depth = max_depth_of(spec_w.drafter)
        observe = lambda tally, tree, made, steps, start: tally.observe_shadow(widths, tree, inp.dp, made, steps, depth)
        carry, live_rounds, n, budgets = plain_chunks.plain_chunks(spec_w, inp, n_i, carry, shadow=(budgets, observe))
      elif shadowed(spec_w, ac):
        carry, live_rounds, n, seen = plain_chunks.plain_chunks(spec_w, inp, n_i, carry,
                                                                shadow=plain_chunks.chain_shadow(inp.dp, b))
      else:
        carry, live_rounds, n = plain_chunks.plain_chunks(spec_w, inp, n_i, carry)
      if spec_w.proposes_tree:
        budgets = budgets.observe_plain(live_rounds)
    elif spec_w.proposes_tree:
      carry, budgets, n = rounds_tallied(spec_w, inp, n_i, carry, budgets, widths)
    else:
      carry, n = rounds_at(spec_w, inp, n_i, carry)
    ran = ran + n
  return carry, dataclasses.replace(ctl, budgets=budgets), ran, seen


@functools.partial(jax.jit, static_argnames=("spec", "ac", "keep"), donate_argnames=("carry",))
def adaptive_run(spec: RoundSpec, inp: RoundInputs, carry: Carry, costs, force, max_rounds, *, ac, keep=None):
  """Segments until every sequence is done or `max_rounds` rounds ran. costs [W] ms per round of
  each width; `force` >= 0 pins the width index and runs one segment of `max_rounds` rounds (the
  cost measurement); `keep`: indices of `ac.widths_for(K)` left by `adapt.prune_widths`.
  -> (carry, (log_width, log_rounds, segments, rounds, replayed tau [W], shadow drafts' totals [2]))."""
  widths = widths_of(spec, ac, keep)
  specs = [dataclasses.replace(spec, width=w) for w in widths]
  choice_costs = adapt.with_margin(costs, widths, ac.margin)      # drafting must predict a clear gain

  def body(c):
    carry, ctl = c
    wi, rounds, span = _choose(spec, ac, carry, ctl, inp, choice_costs, widths, force, max_rounds)
    after, ctl, ran, seen = _segment(specs, ac, inp, carry, ctl, widths, wi, rounds)
    return after, _learn(spec, ac, carry, after, ctl, widths, wi, ran, span, inp.dp["n_max"], seen)

  carry, ctl = jax.lax.while_loop(lambda c: ~jnp.all(c[0].state.done) & (c[1].total < max_rounds), body,
                                  (carry, Control.init(carry, ac, len(widths))))
  r = ctl.replay
  replayed_tau = (ctl.budgets.pooled() if spec.proposes_tree else
                  jnp.sum(r.tokens, 1) / jnp.maximum(jnp.sum(r.rounds, 1), 1e-6))   # [W] pooled, decayed
  return carry, (ctl.log_width, ctl.log_rounds, ctl.segment, ctl.total, replayed_tau, ctl.shadow)


def measure_round_costs(spec: RoundSpec, inp: RoundInputs, carry: Carry, *, ac, timed=True) -> np.ndarray | None:
  """[len(widths)] ms per round at each width (drafting, the [B, w+1] verify forward, acceptance,
  commit, and the controller's per-segment work), timed with the adaptive program itself (width
  pinned by `force`) on copies of the live state with the budget lifted so no sequence stops
  early: one untimed call first (compiles), then three interleaved passes that time a short and a
  long run per width; the cost per round is the difference over the extra rounds (median per
  width), so the per-call cost (launch, the host's wait) drops out. None when the cache has no
  room for a few rounds (or `timed` is off: then it only compiles)."""
  k, state = spec.drafter.max_draft, carry.state
  widths = widths_of(spec, ac)
  room = min(int(state.cache.capacity) - int(jnp.max(state.cache.lengths)),
             int(state.history.shape[1]) - int(jnp.max(state.hist_len))) - 2 * (k + 1)
  long = min(32, max(room, 0) // (k + 1))
  short = min(8, long // 4)
  lifted = dataclasses.replace(inp, max_new=jnp.full_like(inp.max_new, long * (k + 1) + 1))
  costs0 = jnp.ones((len(widths),), jnp.float32)

  def run(i, rounds):
    c = jax.tree_util.tree_map(jnp.copy, carry)
    jax.block_until_ready(c)
    t0 = time.perf_counter()
    out = jax.block_until_ready(adaptive_run(spec, lifted, c, costs0, jnp.int32(i), jnp.int32(rounds), ac=ac))
    ran = int(out[1][3])    # (the whole output waited for: on the CPU a scalar output may be ready first)
    return (time.perf_counter() - t0) * 1e3, ran

  run(len(widths) - 1, min(long, 1) if timed else 0)   # compile (+ first launch)
  if short < 2 or not timed:
    return None
  return adapt.per_round_ms([functools.partial(run, i) for i in range(len(widths))], short, long)


def _segments(kept, log_w, log_r, n_seg) -> list[list[int]]:
  """[[width, rounds], ...] runs of the segment log, consecutive equal widths merged."""
  segments: list[list[int]] = []
  for wi, r in zip(log_w[:min(int(n_seg), ADAPTIVE_LOG)], log_r):
    if r <= 0:
      continue
    if segments and segments[-1][0] == int(kept[wi]):
      segments[-1][1] += int(r)
    else:
      segments.append([int(kept[wi]), int(r)])
  return segments


def adaptive_loop(spec: RoundSpec, inp: RoundInputs, carry: Carry, *, ac, costs, warm=False, cost_key=None):
  """Adaptive drafting for a request. Once per shape (`cost_key`) the round costs of every width are
  timed (`measure_round_costs`) and replace the forward-only calibration; `warm` (a benchmark's
  untimed warm-up passes it) compiles the program, so a later timed run never compiles.
  -> (carry, record of the run: costs, widths, [width, rounds] per segment, replayed tau by width)."""
  if spec.proposes_tree and not spec.drafter.budgeted:
    raise UserError(f"adaptive drafting chooses a tree's node budget; the tree drafter {spec.drafter.name} has "
                    f"none to choose (it does not declare `budgeted` / `propose_budget`)")
  widths = widths_of(spec, ac)
  measure = ac.costs is None and cost_key is not None and cost_key not in adapt.TIMED
  if warm or measure:
    measured = measure_round_costs(spec, inp, carry, ac=ac, timed=measure)
    if measured is not None:
      costs = adapt.remember_costs(cost_key, measured)
  elif ac.costs is None and cost_key in adapt.TIMED:
    # The caller's costs are the forward-only calibration, cached under a key without the drafter;
    # the whole-round costs timed for this shape (and tree drafter) are what the choice must use, and
    # the same costs give the same pruned ladder, so the program the warm-up compiled is reused.
    costs = adapt._COSTS[cost_key]
  kept, kept_costs = adapt.prune_widths(widths, costs, ac.tie)
  record = {"widths": list(kept), "costs_ms": [float(c) for c in kept_costs], "widths_timed": list(widths),
            "measured_ms": (adapt._COSTS[cost_key].tolist() if cost_key in adapt.TIMED else None)}
  if kept == (spec.drafter.max_draft,):   # nothing to choose: the fixed program itself
    carry = device_loop(spec, inp, carry)
    return carry, {**record, "segments": [[int(kept[0]), int(jnp.max(carry.stats.rounds))]], "n_segments": 1,
                   "replayed_tau": None}
  keep = None if kept == widths else tuple(widths.index(w) for w in kept)   # None: the program timing compiled
  carry, probe = adaptive_run(spec, inp, carry, jnp.asarray(kept_costs, jnp.float32), jnp.int32(-1),
                              jnp.int32(2 ** 30), ac=ac, keep=keep)
  log_w, log_r, n_seg, _, tau, shadow = jax.device_get(probe)
  acc, rej = (float(x) for x in shadow)
  return carry, {**record, "segments": _segments(kept, log_w, log_r, n_seg), "n_segments": int(n_seg),
                 "replayed_tau": ([round(float(t), 4) for t in tau]
                                  if spec.drafter.replayable or spec.proposes_tree else None),
                 "shadow": ({"accepted": int(acc), "rejected": int(rej),
                             "alpha": round(acc / (acc + rej), 4) if acc + rej else None}
                            if shadowed(spec, ac) and not spec.proposes_tree else None)}
