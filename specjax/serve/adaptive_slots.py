"""Adaptive drafting over the live slot batch: before every device call (one or more rounds), the
verification width (0: a plain decode step) and each slot's draft length, chosen from the slots'
running acceptance and the measured cost of a round at each width, so that speculation is dropped
where it costs throughput.

The estimates are the offline loops' (`specjax.engine.adaptive`); the rule is throughput, expected
tokens per millisecond over the live slots, since finished slots are refilled (there is no static
batch whose slowest sequence sets the time):

    w = argmax_w  sum_i live_i tau_i(w) / cost(w)

- replayable device drafters (device `ngram_simple`): tau_i(w) is replayed from the stream each
  slot produced, whatever width produced it, plain steps included (`adaptive_replay`,
  `tau_replayed`; refreshed every `segment_rounds` rounds), so nothing needs exploring; before
  anything is replayed every width predicts one token per round, and the cheapest width runs;
- other drafters: the host loop's rule (`choose_width_np`): tau_i(w) = 1 + p_1 + .. + p_min(w, n_i*),
  p_j the batch's acceptance by draft position (`PositionRates`, read optimistically while a
  position is rarely seen) and n_i* the longest draft slot i still reaches with probability
  alpha_i^n >= `reach_min` (`longest_useful` of its censored-geometric `AdaptiveState`). Device
  drafters whose width-0 calls run as plain chunks start each chunk with a shadow draft (its whole
  n_max, not verified, compared with the chunk's tokens: `engine.plain_chunks`), counted as a
  verified draft, so nothing explores. Otherwise every `explore_every` x `segment_rounds` rounds,
  `explore_rounds` rounds let every speculating slot draft its whole n_max, which refreshes the
  positions narrow widths never reach and slots whose acceptance had fallen to nothing.

A slot's estimates restart when a request joins it (the prior; for replay, the batch's pooled
figure), so a drafter that never lands costs a new request a few rounds. A request that turned
speculation off counts one token per round at every width. cost(w) is the wall time of this
server's own rounds at width w in the call's batch bucket: the warm-up's timing first, then a
running average (weight of the past `decay`) of the rounds that ran at w, host overhead and
drafting included, each counted at most `STALL` times the running figure (a call that waited for
the interpreter lock or a compilation would otherwise make its width look dear for many rounds),
plus the device call's fixed cost (timed in the warm-up) shared by the planned call's rounds. The
rounds are measured without that fixed cost, since how many rounds a call runs is the scheduler's
choice, not the width's: measured with it, a width that happened to run in short calls would look
dear, and a width the server never runs would keep a warm-up cost measured in other calls.
A plan holds for one device call of several rounds; without replay, while a quarter or more of
the live slots took their request fewer rounds ago than the call would run, it covers no more
rounds than the freshest of them has been observed (`_rounds_observed`), and one round where the
width wins only on the optimism about rarely seen positions (a probe, which a single round answers).

Device drafters draft up to the round's width at no extra cost, so every speculating slot drafts
min(n_max, width), and the round runs at the narrowest width that holds what the rule asked for;
host drafters pay per drafted token, so each slot drafts min(width, n_i*).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.engine import adaptive as adapt
from specjax.engine.adaptive_replay import ReplayState, replay_segment


STALL = 2.0      # a round's observed time counts at most this multiple of its width's running cost
FRESH_SHARE = 0.25   # without replay, calls are kept short only while this share of live slots is new


@dataclasses.dataclass
class RoundPlan:
  """What the next round runs."""
  width: int               # verification width (0: no slot drafts; a plain decode step where possible)
  lengths: np.ndarray      # [B] int32 draft tokens each slot may propose (<= width)
  rounds: int = 1          # rounds run on this plan (an exploring stretch is not extended past its end)


@functools.partial(jax.jit, static_argnames=("drafter", "widths", "window", "decay", "prior_rounds"))
def _replay(rs: ReplayState, joined, join_len, history, hist_len, *, drafter, widths, window, decay, prior_rounds):
  """Slots that took a request since the last call restart at their length then (joined [B] bool,
  join_len [B]); the replay extends over what every slot produced since.
  -> (replay state, tau [W, B] expected tokens per round at each width)."""
  restart = joined[None, :]
  rs = ReplayState(start=jnp.where(restart, join_len[None, :], rs.start),
                   known=jnp.where(restart, join_len[None, :], rs.known),
                   tokens=jnp.where(restart, 0.0, rs.tokens), rounds=jnp.where(restart, 0.0, rs.rounds))
  rs = replay_segment(rs, drafter.propose_at, history, hist_len, widths, drafter.max_draft, window, decay)
  return rs, adapt.tau_replayed(rs.tokens, rs.rounds, prior_rounds)


class RoundCosts:
  """The measured cost of a round at each width, per batch bucket: the warm-up's timing of every
  width over every slot first (`set_costs`), then a running average of the rounds that ran there
  (`observe_cost`); or the config's fixed costs (`AdaptiveConfig.costs`)."""

  def __init__(self, ac: adapt.AdaptiveConfig, widths: tuple[int, ...]):
    self.ac, self.widths = ac, widths
    self.fixed_costs = ac.costs is not None
    self.costs = None if ac.costs is None else np.asarray(ac.costs, np.float64)   # [W] ms per round
    if self.fixed_costs and len(self.costs) != len(self.widths):
      raise ValueError(f"adaptive costs has {len(self.costs)} entries for widths {self.widths}")
    self._bucket_costs: dict[int, np.ndarray] = {}                          # [W] per bucket smaller than every slot
    self.call_ms = 0.0                                                      # a call's fixed cost besides its rounds
    self.rounds_by_width = {w: 0 for w in self.widths}

  def set_costs(self, costs_ms, call_ms: float = 0.0) -> None:
    """The warm-up's timed cost of a round of every slot at every width, without the fixed cost of
    the call (`call_ms`); both kept as the config gives them when it fixes costs. Smaller buckets
    start from it."""
    if not self.fixed_costs:
      self.costs = np.maximum(np.asarray(costs_ms, np.float64), 1e-3)
      self.call_ms = max(float(call_ms), 0.0)
      self._bucket_costs = {}

  def plan_costs(self, bucket: int | None, rounds: int) -> np.ndarray:
    """[W] ms per round of a call of `rounds` rounds at each width: the round's cost and the call's
    fixed cost shared by its rounds (what the rule divides tokens by)."""
    return self._costs_at(bucket) + self.call_ms / max(rounds, 1)

  def _costs_at(self, bucket: int | None) -> np.ndarray:
    """[W] the running cost of a round at each width over `bucket` gathered slots (None: every slot)."""
    if bucket is None or self.fixed_costs:
      return self.costs
    return self._bucket_costs.setdefault(bucket, self.costs.copy())

  def observe_cost(self, width: int, ms: float, bucket: int | None) -> None:
    """A round ran at `width` over `bucket` slots in `ms` milliseconds (its call's fixed cost apart)."""
    self.rounds_by_width[width] = self.rounds_by_width.get(width, 0) + 1
    if not self.fixed_costs and width in self.widths:
      i, costs = self.widths.index(width), self._costs_at(bucket)
      ms = min(ms, STALL * costs[i])      # a call held up by the host says little about its width
      costs[i] = self.ac.decay * costs[i] + (1.0 - self.ac.decay) * ms

  def cost_record(self) -> dict:
    out = {"widths": list(self.widths), "costs_ms": [round(float(c), 4) for c in self.costs],
           "call_ms": round(self.call_ms, 4),
           "rounds_by_width": {str(w): n for w, n in self.rounds_by_width.items()}}
    if self._bucket_costs:
      out["costs_ms_by_bucket"] = {str(n): [round(float(c), 4) for c in costs] for n, costs in self._bucket_costs.items()}
    return out


class SlotWidthController(RoundCosts):
  """Width and draft lengths for B slots of one chain drafter: `plan` before a call of rounds,
  `observe` after each of its rounds, `join` when a request takes a slot."""

  def __init__(self, ac: adapt.AdaptiveConfig, slots: int, drafter, rounds_per_call: int = 1, shadowed: bool = False):
    """`rounds_per_call`: the most rounds the server runs on one plan (the replay's reach);
    `shadowed`: width-0 calls report shadow drafts (`observe`'s `shadow`), so nothing explores."""
    super().__init__(ac, ac.widths_for(drafter.max_draft))                 # ascending, 0 first
    self.shadowed = shadowed
    self.drafter, self.k = drafter, drafter.max_draft
    self.rounds_per_call = rounds_per_call
    self.device_drafter = drafter.on_device
    self.replayed = drafter.on_device and drafter.replayable
    self.acceptance = adapt.AdaptiveState.init(slots, ac, np)
    self.rates = adapt.PositionRates(self.k, ac)
    self.round = 0
    self._since_replay = 0                                                  # rounds observed since the replay last extended
    self._since_join = np.zeros(slots, np.int64)                           # [B] rounds observed since each slot's request joined
    self.tau = np.ones((len(self.widths), slots))                          # [W, B] replayed
    self._replay_state = None
    self._joined, self._join_len = np.zeros(slots, bool), np.zeros(slots, np.int32)
    self.calls_cut: dict[str, int] = {}       # plans that ran fewer rounds than asked, by the rule that cut them

  def join(self, slot: int, hist_len: int) -> None:
    """A new request in `slot` (its history `hist_len` tokens long): its estimates restart."""
    prior = adapt.AdaptiveState.init(1, self.ac, np)
    self.acceptance.accepted[slot], self.acceptance.trials[slot] = prior.accepted[0], prior.trials[0]
    self._joined[slot], self._join_len[slot] = True, hist_len
    self._since_join[slot] = 0
    self.tau[:, slot] = np.mean(self.tau, axis=1) if self.replayed else 1.0

  def plan(self, n_max: np.ndarray, n_min: np.ndarray, live: np.ndarray, rounds: int = 1,
           bucket: int | None = None) -> RoundPlan:
    """The plan of the next call of up to `rounds` rounds over `bucket` gathered slots (None: every
    slot), whose costs the rule reads. Without replay a plan covers no more rounds than the freshest
    slots have been observed while many slots are fresh (`_rounds_observed`: a joining slot starts
    from the prior, which each round's observation corrects; replay refreshes per segment, whatever
    the calls), nor past the start or end of an exploring stretch. n_max [B] each slot's request
    limit (0: speculation off), n_min [B], live [B] bool."""
    if not self.replayed:
      rounds = self._cut("fresh", rounds, self._rounds_observed(rounds, live))
    n_max = np.where(live, n_max, 0)
    period = self.ac.explore_every * self.ac.segment_rounds
    at = self.round % period
    exploring = not self.replayed and not self.shadowed and at < self.ac.explore_rounds
    if not self.replayed and not self.shadowed:        # a call ends where an exploring stretch starts or ends
      rounds = self._cut("explore", rounds, min(rounds, self.ac.explore_rounds - at if exploring else period - at))
    costs = self.plan_costs(bucket, rounds)
    if self.replayed:
      width = self.widths[self._best_replayed(n_max, live, costs)]
      asked = np.minimum(n_max, width)
    elif exploring:
      asked = n_max                                       # exploring: every speculating slot drafts all it may
    else:
      caps = adapt.longest_useful(self.acceptance.alpha, n_max, self.ac.reach_min)       # [B]
      wi = adapt.choose_width_np(self.rates.optimistic(self.ac.optimism), caps, live, self.widths, costs)
      if wi != adapt.choose_width_np(self.rates.rates, caps, live, self.widths, costs):
        rounds = self._cut("probe", rounds, 1)   # a probe (the width wins on optimism about rarely seen positions)
      asked = np.minimum(self.widths[wi], caps)
    width = self._holding(int(asked.max(initial=0)))
    lengths = np.minimum(n_max, width) if self.device_drafter else asked
    lengths = np.where(lengths < n_min, 0, lengths).astype(np.int32)      # shorter drafts would not be verified
    self.round += rounds
    return RoundPlan(width=width if lengths.any() else 0, lengths=lengths, rounds=rounds)

  def _cut(self, rule: str, rounds: int, allowed: int) -> int:
    """`allowed` rounds, counted under `rule` in `calls_cut` when fewer than `rounds` (each of a
    call's cuts counts once)."""
    if allowed < rounds:
      self.calls_cut[rule] = self.calls_cut.get(rule, 0) + 1
    return allowed

  def _best_replayed(self, n_max, live, costs) -> int:
    """Index of the width with the most replayed tokens per ms over the live slots; a slot drafts
    at most its n_max, so at a wider width it counts its tau at the widest width it reaches."""
    idx = np.arange(len(self.widths))
    reach = np.searchsorted(self.widths, n_max, side="right") - 1                   # [B] widest width <= n_max
    eff = np.minimum(idx[:, None], reach[None, :])                                  # [W, B]
    tau = np.take_along_axis(self.tau, eff, axis=0)
    gain = np.sum(np.where(live[None, :], tau, 0.0), axis=1)                        # [W]
    return int(np.argmax(gain / costs))

  def _rounds_observed(self, rounds: int, live: np.ndarray) -> int:
    """The rounds a plan may cover without replay: while at least `FRESH_SHARE` of the live slots
    took their request fewer than `rounds` rounds ago (their estimates still the prior), no more
    rounds than the freshest of them has been observed, so each round's observation corrects the
    prior before a long call runs on it; a few fresh slots among many do not move the batch's
    width, and limiting every call for them (a request joins at almost every call under load)
    would make every call short and pay its fixed cost again and again."""
    fresh = live & (self._since_join < rounds)
    if fresh.sum() < FRESH_SHARE * max(int(live.sum()), 1):
      return rounds
    return max(1, min(rounds, int(self._since_join[fresh].min())))

  def _holding(self, n: int) -> int:
    """The narrowest width that holds a draft of n tokens."""
    return next(w for w in self.widths if w >= min(n, self.k))

  def observe(self, plan: RoundPlan, width: int, drafted, accepted, live, ms: float, history, hist_len,
              bucket: int | None = None, ranks=None, shadow=None) -> None:
    """After a round that ran at `width` (host drafters: the width their drafts needed) over
    `bucket` gathered slots in `ms` milliseconds: drafted [B] draft tokens verified, accepted [B],
    live [B] (before the round); history [B, H] and hist_len [B]: the slot batch's token history
    now (device arrays); `ranks` (tree rounds' path ranks) unused; `shadow` [2, B]: a width-0
    round's shadow drafts (positions observed, accepted; `slot_programs.run_rounds`), counted as
    verified drafts of those lengths."""
    self.acceptance = adapt.update(self.acceptance, drafted, accepted, live, self.ac.decay)
    if plan.lengths.any():
      self.rates.observe_round(plan.lengths, accepted, live)
    if shadow is not None and width == 0 and np.any(shadow[0] > 0):
      self.acceptance = adapt.update(self.acceptance, shadow[0], shadow[1], live, self.ac.decay)
      self.rates.observe_round(shadow[0], shadow[1], live)
    self.observe_cost(width, ms, bucket)
    self._since_replay += 1
    self._since_join += live
    if self.replayed and self._since_replay >= self.ac.segment_rounds:
      self._extend_replay(history, hist_len)

  def compile(self, history, hist_len) -> None:
    """Compile the replay now (on the slot batch as it is), so no timed round pays for it."""
    if self.replayed:
      self._extend_replay(history, hist_len)

  def _extend_replay(self, history, hist_len) -> None:
    if self._replay_state is None:
      self._replay_state = ReplayState.init(jnp.asarray(self._join_len), len(self.widths))
    self._since_replay = 0
    rounds = self.ac.segment_rounds + self.rounds_per_call - 1      # at most this many since the last extension
    window = rounds * (self.k + 1) + self.k + 1                     # what a slot produces in that many rounds
    self._replay_state, tau = _replay(self._replay_state, jnp.asarray(self._joined), jnp.asarray(self._join_len),
                                      history, hist_len, drafter=self.drafter, widths=self.widths, window=window,
                                      decay=self.ac.decay, prior_rounds=self.ac.prior_rounds)
    self.tau = np.asarray(tau, np.float64)
    self._joined[:] = False

  def record(self) -> dict:
    """Widths, their current costs, rounds run at each, and the estimates the rule reads."""
    out = self.cost_record()
    if self.replayed:
      out["replayed_tau"] = [round(float(t), 4) for t in np.mean(self.tau, axis=1)]
    else:
      out["acceptance_by_position"] = [round(float(p), 4) for p in self.rates.rates]
    out["calls_cut"] = dict(self.calls_cut)
    return out
