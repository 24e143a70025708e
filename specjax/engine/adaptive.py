"""Adaptive drafting: per-sequence draft lengths from running acceptance, and a batch-wide
verification width chosen by measured cost and measured (or replayed) acceptance, backing off to
plain decoding when speculation does not pay.

The device loop (`adaptive_loop.adaptive_run`) is one jitted program: a while_loop over segments of
`segment_rounds` rounds; before each, the controller (`choose_width_device`) picks the width w that
finishes the batch soonest,

    w = argmin_w  cost(B, w) * max over live sequences i of remaining_i / tau_i(w),

and the segment runs at that static width (w = 0: plain decode steps; the body holds one while_loop
per width, all but the chosen one running zero rounds). A static batch runs until its slowest
sequence is done, so at a large batch one sequence with nothing to look up keeps the round count of
plain decoding, and speculation then only adds cost per round: the batch's mean tau says little
(at batch 64 on MT-bench every fixed n_max was slower than plain decoding despite a mean tau above
1.2: experiments/results/raw/adaptive_h100_3e8cc57/adaptive_smollm2_b64.json); at batch 1 the rule
is tokens per ms. cost(B, w) is the milliseconds of a round, timed once per shape in the warm-up
with the same program (width pinned; `remember_costs`): costs timed with any other program
disagree with the segments' wall times and make the controller hop between widths (`calibrate` is
only a forward-only first estimate). tau_i(w), expected tokens per round:

- replayed (`adaptive_replay`) for drafters whose drafts are point masses computed from the history
  alone (device ngram_simple): from the stream produced so far, whatever width produced it, the
  rounds speculation at every width would have taken, per sequence, shrunk toward the batch's
  figure by `prior_rounds` rounds; nothing needs exploring and plain-decoding segments still learn.
  Replay, not the geometric model below, because for n-gram drafters the geometric model
  over-predicts wide widths and keeps the loop at a width that runs slower than a narrow one.
- trees (`adaptive_tree`): the width is the node budget (a budget-w tree is the best w nodes of a
  wider one), so every round at budget b shows what each budget w <= b would have accepted, read
  off the ranks of the accepted path's nodes; the first segment explores the widest budget, every
  `explore_every`-th the budget one above the chosen one.
- otherwise censored-geometric per sequence: alpha_i = accepted / (accepted + rejections), decayed
  per segment, tau = 1 + alpha + .. + alpha^w. Chain drafters caught up in plain chunks at width 0
  (MTP, EAGLE-3, DFlash, ngram_mod) start each chunk with a shadow draft, compared with the chunk's
  tokens and counted as a verified draft (`shadow_drafts`), so backing off keeps learning and no
  segment explores: the first (`explore_rounds` long) runs the width the prior acceptance chooses, which
  at a large batch, where a round costs far more than a plain step, is plain decoding. Without
  shadow drafts positions beyond the chosen width get no evidence: the first segment and every
  `explore_every`-th is a short one (`explore_rounds`) at the widest width.

Ties in predicted time go to the widest width (within `tie`, default exact ties only: estimates from
the stream so far understate wide widths, but a tie of a few percent let a narrow width win over
plain decoding where it ran slower), and before the run every width that a wider width matches in
cost per round (within the tie) is pruned (`prune_widths`): a wider chain drafts at least the tokens
a narrower one would. A round at a narrow width can time dearer than one at a wide width (at batch 1
width 8 timed cheapest of all widths: `measured_ms` in
experiments/results/raw/adaptive_h100_0458cdb/adaptive_smollm2_b1.json), so those go; with every
width but one pruned the program is the fixed loop at that width, with no segments.

Why segments of while_loops chosen on the device: a `lax.switch` over widths every round ran rounds
slower than the fixed loop (probably copies of the KV cache through the conditional; per segment
such a cost is paid once per `segment_rounds` rounds), and segments driven from the host cost
several milliseconds each beyond their rounds (experiments/README.md, adaptive drafting).

The host loop (`HostController`, numpy, host drafters) chooses every round from acceptance by
position p_j (`PositionRates`): w = argmax sum_i live_i (1 + p_1 + .. + p_min(w, n_i*)) / cost(w),
where a sequence drafts at most n_i* tokens, the longest whose last token is still reached with
probability alpha_i^n >= `reach_min` (host drafting costs time per token).

Off / on: `speculative_generate(..., adaptive=AdaptiveConfig())`, bench methods `adaptive: true`.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
  decay: float = 0.8              # weight of the past in the running estimates (host loop: per round; device
                                  # loop: per segment)
  reach_min: float = 0.2          # host loop: draft while the last token is reached with at least this
                                  # probability (host drafting costs time per token)
  prior_alpha: float = 0.5        # starting per-token acceptance (weight `prior_weight` rounds)
  prior_weight: float = 2.0
  optimism: float = 0.5           # host loop: the width choice reads p_j + optimism / sqrt(n_j) (n_j: decayed
                                  # draft positions observed), so a few early rounds with no n-gram match
                                  # yet do not lock the controller into width 0
  widths: tuple[int, ...] | None = None   # verification widths to choose from (default 0, 1, 2, 4, .., K; trees:
                                          # node budgets, default 0, tree_min_nodes, 2x, .., n_nodes)
  tree_min_nodes: int = 4         # trees: the smallest node budget above 0 of the default ladder
  costs: tuple[float, ...] | None = None  # ms per width, given instead of measured (`calibrate`)
  segment_rounds: int = 16        # device loop: rounds per segment; the width is chosen per segment, on the
                                  # device (segments driven from the host cost milliseconds each beyond
                                  # their rounds)
  prior_rounds: float = 8.0       # device loop: a sequence's replayed tokens per round are shrunk toward
                                  # the batch's by this many rounds
  explore_rounds: int = 4         # rounds at the widest width that refresh the estimates of every position:
                                  # the first segment, then one every `explore_every` segments
  explore_every: int = 8          # (host loop: every explore_every x segment_rounds rounds)
  shadow_rounds: int = 32         # host loop: plain segments of at most this many rounds, each after a draft
                                  # that is not verified but compared with the tokens the segment makes (the
                                  # host loop's exploration; the first segment a quarter as long); 0: off,
                                  # the host loop explores with rounds at the widest width instead
  shadow_drafts: bool = True      # device loop, chain drafters caught up in plain chunks at width 0 (MTP, EAGLE-3,
                                  # DFlash, ngram_mod): each chunk starts with a draft that is not verified but
                                  # compared with the chunk's tokens, and the acceptance estimate learns from it,
                                  # so no segment explores (trees: only the first); off: an exploring segment
                                  # first and every `explore_every` segments
  backoff_segments: int = 2       # device loop, replayed drafters and shadow drafts: at most this many segments
                                  # run as one at width 0 (other drafters run width 0 up to their next exploring
                                  # segment)
  margin: float = 0.1             # a drafting width is chosen over width 0 (plain decoding) only if it predicts
                                  # finishing at least this fraction sooner: what the estimates leave out (a
                                  # segment's own cost, the acceptance's noise) falls on drafting, never on plain
  tie: float = 0.0                # device loop: widths whose predicted time is within this fraction of the best
                                  # tie, and the widest of them is chosen; a width is pruned when a wider one
                                  # costs at most (1 + tie) times as much per round (`prune_widths`). Exact
                                  # ties by default: a few percent let width 1 win over plain decoding at
                                  # batch 32, where it ran slower (experiments/README.md, adaptive drafting)

  def widths_for(self, k: int, tree: bool = False) -> tuple[int, ...]:
    """The widths (trees: node budgets) to choose from for a drafter of K tokens (nodes), ascending."""
    if self.widths is not None:
      ws = sorted({min(int(w), k) for w in self.widths} | {0})
    else:
      ws, w = {0, k}, max(1, min(self.tree_min_nodes, k)) if tree else 1
      while w < k:
        ws.add(w)
        w *= 2
      ws = sorted(ws)
    return tuple(ws)


def _xp(x):
  """numpy for host arrays (the host loop), jax.numpy for device arrays and tracers (the device loop):
  the estimator below is written once for both."""
  return np if isinstance(x, (np.ndarray, np.generic)) else jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptiveState:
  accepted: jax.Array   # [B] f32 decayed accepted draft tokens
  trials: jax.Array     # [B] f32 decayed accepted tokens + rejections

  @staticmethod
  def init(batch: int, ac: AdaptiveConfig, xp=jnp) -> "AdaptiveState":
    full = lambda v: xp.full((batch,), v, xp.float32)
    return AdaptiveState(accepted=full(ac.prior_alpha * ac.prior_weight), trials=full(ac.prior_weight))

  @property
  def alpha(self) -> jax.Array:
    xp = _xp(self.accepted)
    return xp.clip(self.accepted / xp.maximum(self.trials, 1e-6), 0.0, 0.999)


def longest_useful(alpha, n_max, reach_min: float):
  """[B] the longest n <= n_max with alpha^n >= reach_min (0 when even one token is not worth it)."""
  xp = _xp(alpha)
  if reach_min <= 0:                   # no cap: every sequence drafts up to n_max
    return xp.broadcast_to(xp.asarray(n_max), alpha.shape).astype(xp.int32)
  logs = xp.minimum(xp.log(xp.maximum(alpha, 1e-6)), -1e-6)
  return xp.clip(xp.floor(np.log(reach_min) / logs), 0, n_max).astype(xp.int32)


def expected_gain(rates, caps, live, widths: tuple[int, ...]) -> np.ndarray:
  """[W] expected tokens per round, summed over live sequences, at each width: sequence i drafts
  min(w, caps_i) tokens and position j is accepted with probability rates[j-1] (prefix sums)."""
  rates = np.asarray(rates, np.float64)
  cum = np.concatenate([[0.0], np.cumsum(rates)])                                          # [K+1]
  n_w = np.minimum(np.minimum(np.asarray(widths)[:, None], np.asarray(caps)[None, :]), len(rates))   # [W, B]
  return np.sum(np.where(np.asarray(live)[None, :], 1.0 + cum[n_w], 0.0), axis=1)


def choose_width_np(rates, caps, live, widths: tuple[int, ...], costs) -> int:
  """Index into widths maximizing expected tokens per ms."""
  return int(np.argmax(expected_gain(rates, caps, live, widths) / np.asarray(costs, np.float64)))


def update(ast: AdaptiveState, dlen, n_acc, live, decay: float) -> AdaptiveState:
  """After a round: dlen [B] verified draft lengths, n_acc [B] accepted, live [B]."""
  xp = _xp(ast.accepted)
  drafted = live & (dlen > 0)
  return update_totals(ast, xp.where(drafted, n_acc, 0), xp.where(drafted, n_acc < dlen, 0), decay)


def update_totals(ast: AdaptiveState, accepted, rejections, decay: float) -> AdaptiveState:
  """After rounds that accepted `accepted` [B] draft tokens and rejected `rejections` [B] drafts
  (one round, or a device-loop segment's totals); sequences with neither keep their estimate."""
  xp = _xp(ast.accepted)
  seen = (accepted + rejections) > 0
  acc = xp.where(seen, decay * ast.accepted + accepted, ast.accepted)
  trials = xp.where(seen, decay * ast.trials + accepted + rejections, ast.trials)
  return AdaptiveState(accepted=acc.astype(xp.float32), trials=trials.astype(xp.float32))


class PositionRates:
  """Batch-wide acceptance by draft position, p_j = P(position j accepted | a draft through j was
  asked for), decayed per observation; positions nobody was asked for keep their estimate. The
  host loop feeds it every round (`observe_round`)."""

  def __init__(self, k: int, ac: "AdaptiveConfig"):
    self.hits = ac.prior_weight * ac.prior_alpha ** np.arange(1, k + 1, dtype=np.float64)
    self.asked = np.full(k, ac.prior_weight, np.float64)
    self.decay = ac.decay

  def add(self, hits, asked) -> None:
    """hits [K], asked [K]: new counts of drafts accepted through / asked for through position j."""
    hits, asked = np.asarray(hits, np.float64), np.asarray(asked, np.float64)
    seen = asked > 0
    self.hits = np.where(seen, self.decay * self.hits + hits, self.hits)
    self.asked = np.where(seen, self.decay * self.asked + asked, self.asked)

  def observe_round(self, asked, n_acc, live) -> None:
    """One host-loop round: asked [B] requested draft lengths, n_acc [B] accepted, live [B]."""
    pos = np.arange(len(self.hits))[None, :]
    live = np.asarray(live)[:, None]
    self.add(np.sum(live & (np.asarray(n_acc)[:, None] > pos), axis=0),
             np.sum(live & (np.asarray(asked)[:, None] > pos), axis=0))

  @property
  def rates(self) -> np.ndarray:
    """[K], non-increasing in j (accepting j means accepting every position before it; stale
    estimates of unexplored positions could say otherwise)."""
    return self.optimistic(0.0)

  def optimistic(self, optimism: float) -> np.ndarray:
    """[K] the rates plus optimism / sqrt(observations) per position, capped at 1 and
    non-increasing: what the width choice reads (an upper-confidence choice: a position seen
    rarely is worth trying)."""
    up = self.hits / np.maximum(self.asked, 1e-9) + optimism / np.sqrt(np.maximum(self.asked, 1e-9))
    return np.minimum.accumulate(np.clip(up, 0.0, 1.0))


# ----------------------------------------------------------------------------------------------
# the cost of a verification width, measured


_COSTS: dict = {}


def cost_key(params, cfg, batch: int, capacity: int, widths: tuple[int, ...], drafter=None) -> tuple:
  """What timed costs are cached under. `drafter` (the device loop passes its drafter: a round's
  drafting is part of its cost, an MTP head's three steps are not an n-gram lookup's, and drafters
  share width ladders) keys them per drafter too; without it, the forward-only calibration's key."""
  dtype = jax.tree_util.tree_leaves(params)[0].dtype
  return (cfg, batch, capacity, widths, str(dtype), jax.default_backend()) + ((drafter,) if drafter is not None else ())


TIMED: set = set()        # shapes whose cached costs are timed whole rounds (not `calibrate`'s forwards)


def per_round_ms(runs, short: int, long: int, passes: int = 3) -> np.ndarray:
  """ms per round of each `run(n) -> (ms, rounds run)`: the difference of a long and a short run
  over their extra rounds, so the per-call cost (launch, the host's wait) drops out; the median of
  `passes` passes, each taking the runs in turn (drift hits them alike). [len(runs)], >= 1e-3."""
  ms = [[] for _ in runs]
  for _ in range(passes):
    for i, run in enumerate(runs):
      (t_s, r_s), (t_l, r_l) = run(short), run(long)
      ms[i].append((t_l - t_s) / (r_l - r_s) if r_l > r_s else t_l / max(r_l, 1))
  return np.asarray([max(float(np.median(m)), 1e-3) for m in ms], np.float32)


def remember_costs(key: tuple, costs) -> np.ndarray:
  """Replace the cached costs of a shape by better ones (the device loop times whole rounds once
  per shape: `adaptive_loop.measure_round_costs`). Kept as timed, not made non-decreasing in the width:
  a round at width 0 is a one-token decode step, which can cost more than a round at width 1 (a
  different program, and a different attention path when one-token decode stays on the XLA
  reference: `kernels.verify_attention`, SPECJAX_VERIFY_ATTENTION_DECODE=0); raising every width
  to width 0's figure would make the costs flat, and the controller would choose the widest width
  where a narrow one is faster."""
  out = np.maximum(np.asarray(costs, np.float32), 1e-3)
  TIMED.add(key)
  _COSTS[key] = out
  return out


def calibrate(params, cfg, batch: int, capacity: int, widths: tuple[int, ...], *, context: int = 0,
              repeats: int = 5) -> np.ndarray:
  """[len(widths)] median ms of one target forward of w + 1 tokens per sequence at this batch and
  cache capacity (cache filled to `context`). Cached per shape, so a benchmark's warm-up pays it.
  A first estimate: it leaves out the sampling / acceptance over [B, w+1, V] and the drafting, so at
  a large batch it grows too little with w (the controller would choose wide widths that cost as
  much as fixed n_max 8); the device loop's warm-up replaces it by timed whole rounds."""
  from specjax.engine.generation import target_of
  key = cost_key(params, cfg, batch, capacity, widths)
  dtype = jax.tree_util.tree_leaves(params)[0].dtype
  if key in _COSTS:
    return _COSTS[key]
  target = target_of(cfg)
  ctx = min(context or capacity // 2, capacity - max(widths) - 1)
  state = target.init_state(cfg, batch, capacity, dtype)
  state = jax.tree_util.tree_map(lambda x: x, state)
  if hasattr(state, "with_lengths"):
    state = state.with_lengths(jnp.full((batch,), ctx, jnp.int32))
  costs = []
  for w in widths:
    fwd = jax.jit(functools.partial(_forward_logits, target=target, cfg=cfg))
    toks = jnp.zeros((batch, w + 1), jnp.int32)
    jax.block_until_ready(fwd(params, toks, state))
    ts = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(fwd(params, toks, state))
      ts.append(time.perf_counter() - t0)
    costs.append(float(np.median(ts)) * 1e3)
  out = np.maximum(np.asarray(costs, np.float32), 1e-3)
  out = np.maximum.accumulate(out)      # a wider forward never costs less (timer noise aside)
  _COSTS[key] = out
  return out


def _forward_logits(params, tokens, state, *, target, cfg):
  logits, _, _ = target.forward(params, cfg, tokens, state)
  return jnp.argmax(logits, axis=-1)     # what verification reads; keeps the LM head live


def with_margin(costs, widths: tuple[int, ...], margin: float):
  """costs [W] with every drafting width's raised by the fraction `margin` (width 0 as it is), so a
  width-choice rule picks drafting only where it predicts that much gain. numpy or jax arrays."""
  xp = _xp(costs)
  return costs * xp.where(xp.asarray(widths) > 0, 1.0 + margin, 1.0).astype(costs.dtype)


def choose_width_finish(rates, caps, live, remaining, widths: tuple[int, ...], costs) -> int:
  """Index into widths of the width that finishes a static batch soonest (the host loop's form of
  `choose_width_device`): sequence i drafts min(w, caps_i) tokens, position j accepted with
  probability rates[j-1], and the batch runs until its slowest live sequence has its `remaining`
  tokens. Ties go to the narrower width."""
  rates = np.asarray(rates, np.float64)
  cum = np.concatenate([[0.0], np.cumsum(rates)])                                          # [K+1]
  n_w = np.minimum(np.minimum(np.asarray(widths)[:, None], np.asarray(caps)[None, :]), len(rates))   # [W, B]
  tau = 1.0 + cum[n_w]                                                                     # [W, B]
  need = np.max(np.where(np.asarray(live)[None, :], np.asarray(remaining, np.float64)[None, :] / tau, 0.0), axis=1)
  return int(np.argmin(np.asarray(costs, np.float64) * need))


class HostRoundCosts:
  """The host loop's ms per round at each width, learned from the rounds it runs: a host round
  (the host's draft, one device call, the wait) at its verification width, and width 0 as plain
  decoding steps on the device (a plain segment's ms per step). Starts from `prior` (the
  forward-only calibration, which leaves out the host's drafting and transfers); a width not run
  yet reads its prior scaled by what the runs so far cost against their priors."""

  def __init__(self, widths: tuple[int, ...], prior, decay: float, plain_ms: float | None = None, learn: bool = True):
    self.widths, self.decay, self.learn = widths, decay, learn
    self.prior = np.asarray(prior, np.float64).copy()
    self.seen = np.zeros(len(widths), bool)
    self.ms = self.prior.copy()
    self.ratio = 1.0                     # decayed mean of measured / prior over host rounds
    if plain_ms is not None and widths[0] == 0:
      self.ms[0], self.seen[0] = plain_ms, True

  def observe(self, width: int, ms: float, rounds: int = 1) -> None:
    if not self.learn or width not in self.widths:
      return
    i = self.widths.index(width)
    per = ms / max(rounds, 1)
    if self.seen[i]:
      per = min(per, 4.0 * self.ms[i])      # a round held up by the host (a collection, a page fault) says little
    self.ms[i] = per if not self.seen[i] else self.decay * self.ms[i] + (1 - self.decay) * per
    self.seen[i] = True
    if width > 0:
      self.ratio = self.decay * self.ratio + (1 - self.decay) * per / max(self.prior[i], 1e-6)

  @property
  def costs(self) -> np.ndarray:
    return np.where(self.seen, self.ms, self.prior * np.where(np.asarray(self.widths) > 0, self.ratio, 1.0))


class HostController:
  """The same controller for the host loop (numpy, no device round trip): `lengths` before a
  round, `observe` after it. The first `explore_rounds` rounds, and as many every
  `explore_every` x `segment_rounds` rounds, run at the widest width. Given the sequences'
  `remaining` tokens it chooses the width that finishes the batch soonest (a static batch waits
  for its slowest sequence), else the one with the most tokens per ms; costs per width are
  learned from the rounds run (`HostRoundCosts`; width 0 at `plain_ms`, a plain decoding step, when
  given: such rounds run on the device in one call)."""

  def __init__(self, ac: AdaptiveConfig, batch: int, k: int, costs: np.ndarray, plain_ms: float | None = None,
               shadow: bool = False):
    self.ac, self.widths = ac, ac.widths_for(k)
    self.shadow = shadow and ac.shadow_rounds > 0     # explore with shadow drafts, not rounds at the widest width
    # costs the config gives are kept as given; otherwise learned from the rounds run
    self.round_costs = HostRoundCosts(self.widths, costs, ac.decay, plain_ms, learn=ac.costs is None)
    self.state = AdaptiveState.init(batch, ac, np)
    self.rates = PositionRates(k, ac)
    self.asked = np.zeros(batch, np.int64)
    self.round = 0
    self.chosen: list[int] = []        # the width of every round

  @property
  def costs(self) -> np.ndarray:
    return self.round_costs.costs

  @costs.setter
  def costs(self, value) -> None:      # fixed costs (tests, `AdaptiveConfig.costs`)
    self.round_costs = HostRoundCosts(self.widths, value, self.ac.decay, learn=False)

  def lengths(self, n_max: np.ndarray, live: np.ndarray, remaining: np.ndarray | None = None) -> np.ndarray:
    caps = longest_useful(self.state.alpha, n_max, self.ac.reach_min)
    if not self.shadow and self.round % (self.ac.explore_every * self.ac.segment_rounds) < self.ac.explore_rounds:
      w = self.widths[-1]
    else:
      rates = self.rates.optimistic(self.ac.optimism)
      costs = with_margin(self.costs, self.widths, self.ac.margin)
      w = self.widths[choose_width_np(rates, caps, live, self.widths, costs) if remaining is None else
                      choose_width_finish(rates, caps, live, remaining, self.widths, costs)]
    self.round += 1
    self.chosen.append(int(w))
    self.asked = np.where(live, np.minimum(w, caps), 0)
    return self.asked

  def retract(self) -> None:
    """Forget the last `lengths` (the host loop decides again once the tokens of the segment on the
    device are in)."""
    self.round -= 1
    self.chosen.pop()

  @property
  def max_plain_rounds(self) -> int:
    """The most rounds `plain_rounds_ahead` asks for (the host loop's segment window, static)."""
    return self.ac.shadow_rounds if self.shadow else self.ac.explore_every * self.ac.segment_rounds

  def plain_rounds_ahead(self) -> int:
    """After `lengths` asked no sequence for a draft: the rounds from that one up to the next
    exploring round. A round without drafts adds no observation, so until then only a sequence
    finishing (fewer live rows in the choice) could change what `lengths` asks; the host loop
    runs these rounds as plain decoding steps in one device call."""
    if self.shadow:   # a shadow draft's observation may change the choice: one segment per shadow draft
      return max(self.ac.shadow_rounds // 4, 1) if self.round <= 1 else self.ac.shadow_rounds
    period = self.ac.explore_every * self.ac.segment_rounds
    return period - (self.round - 1) % period

  def shadow_lengths(self, n_max: np.ndarray, live: np.ndarray) -> np.ndarray:
    """Before a plain segment: the draft lengths to ask for a shadow draft (not verified; compared
    with the segment's tokens by `observe_shadow`): every position up to n_max, so the rates of
    wide widths are observed too."""
    return np.where(live, n_max, 0)

  def observe_shadow(self, asked: np.ndarray, matched: np.ndarray, live: np.ndarray) -> None:
    """A shadow draft of `asked` [B] tokens (positions the segment produced tokens for) of which the
    first `matched` [B] equal the tokens the target made: what verifying it would have accepted
    (greedy exactly; sampled, a point-mass draft is accepted where the target's own sample equals
    it). Counted as a verified round's observation."""
    self.state = update(self.state, asked, matched, live, self.ac.decay)
    self.rates.observe_round(asked, matched, live)

  def ran_plain(self, rounds: int) -> None:
    """`rounds` more rounds ran at width 0 after the one `lengths` chose (a plain segment)."""
    self.round += rounds
    self.chosen.extend([0] * rounds)

  def observe_cost(self, width: int, ms: float, rounds: int = 1) -> None:
    """A host round at verification width `width` took `ms`, or a plain segment (width 0) of
    `rounds` steps did."""
    self.round_costs.observe(width, ms, rounds)

  def observe(self, dlen: np.ndarray, n_acc: np.ndarray, live: np.ndarray) -> None:
    self.state = update(self.state, dlen, n_acc, live, self.ac.decay)
    self.rates.observe_round(self.asked, n_acc, live)

  def record(self) -> dict:
    """What the controller did: the widths, their costs, and [width, rounds] runs in order (the
    device loop's record has the same form)."""
    runs: list[list[int]] = []
    for w in self.chosen:
      if runs and runs[-1][0] == w:
        runs[-1][1] += 1
      else:
        runs.append([w, 1])
    return {"widths": list(self.widths), "costs_ms": [float(c) for c in self.costs],
            "prior_ms": [float(c) for c in self.round_costs.prior], "segments": runs}


# ----------------------------------------------------------------------------------------------
# the device loop's controller (runs inside the jitted loop, between segments)


def tau_replayed(tokens, rounds, prior_rounds: float):
  """[W, B] expected tokens per round at each width, per sequence, from replayed rounds
  (`adaptive_replay`), shrunk toward the batch's pooled figure by `prior_rounds` rounds; 1 (no
  gain from drafting) before anything is replayed. numpy or jax arrays."""
  xp = _xp(tokens)
  pooled = xp.where(xp.sum(rounds, 1) > 0, xp.sum(tokens, 1) / xp.maximum(xp.sum(rounds, 1), 1e-6), 1.0)   # [W]
  return (tokens + prior_rounds * pooled[:, None]) / (rounds + prior_rounds)


def tau_geometric(alpha, widths: tuple[int, ...]):
  """[W, B] expected tokens per round when each draft token is accepted with probability alpha [B]
  given the ones before: 1 + alpha + .. + alpha^w (drafters whose acceptance cannot be replayed)."""
  w = jnp.asarray(widths, jnp.float32)[:, None]                                              # [W, 1]
  a = jnp.clip(alpha, 0.0, 0.999)[None, :]
  return (1.0 - a ** (w + 1)) / (1.0 - a)


def choose_width_device(tau, live, remaining, costs, tie: float = 0.0):
  """Index of the width that finishes the batch soonest: a static batch runs until its slowest
  sequence is done, so the time left at width w is cost(w) x max over live sequences of
  remaining_i / tau_i(w) rounds. tau [W, B], live [B], remaining [B] tokens, costs [W] ms per round
  (widths ascending). Widths within a fraction `tie` of the best time tie, and the widest of them
  wins: a chain's tokens per round never fall with its width, and estimates from the stream so far
  understate the wide widths (a match longer than any seen yet counts only once it happens). At
  batch 1 this is tokens per ms; at batch 64 a few sequences with nothing to look up keep the round
  count of plain decoding, and the controller backs off."""
  need = jnp.max(jnp.where(live[None, :], remaining[None, :].astype(jnp.float32) / tau, 0.0), axis=1)   # [W]
  t = costs * need
  near = t <= jnp.min(t) * (1.0 + tie)                                                       # [W]
  return (t.shape[0] - 1 - jnp.argmax(near[::-1])).astype(jnp.int32)


def prune_widths(widths: tuple[int, ...], costs, tie: float) -> tuple[tuple[int, ...], np.ndarray]:
  """The widths worth a place in the device loop, and their costs: width w goes when a wider one
  costs at most (1 + tie) times as much per round, since a wider chain drafts at least the tokens
  a narrower one would, so it is never worse by more than that. Narrow widths can time dearer per
  round than wide ones (at batch 1, every width below 8: `measured_ms` in
  experiments/results/raw/adaptive_h100_0458cdb/adaptive_smollm2_b1.json): they go. Every width left is a
  while_loop in the program (and a command buffer to update per call); one width left is the fixed
  loop, without the per-segment replay and width choice."""
  c = np.asarray(costs, np.float64)
  keep = [i for i in range(len(widths)) if not any(c[j] <= c[i] * (1.0 + tie) for j in range(i + 1, len(widths)))]
  return tuple(widths[i] for i in keep), np.asarray([costs[i] for i in keep], np.float32)
