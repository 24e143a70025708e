"""Adaptive drafting (specjax.engine.adaptive): the controller's choices follow acceptance and cost, and
generation with it stays lossless (greedy identical to plain decoding; sampled output keeps the
target's law) on the device loop and the host loop, including rounds that back off to plain
decoding."""

from __future__ import annotations

import dataclasses
import importlib

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import perturb
from specjax.engine import adaptive as adapt
from specjax.engine.decode import generate_plain
from specjax.drafters.base import DraftParams
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram_simple import NgramSimple
from specjax.drafters.ngram_device import NgramSimpleDevice
from specjax.engine.adaptive_loop import timing_key
from specjax.engine.adaptive_replay import ReplayState, replay_segment
from specjax.engine.round import RoundSpec
from specjax.engine import speculative_generate
from specjax.engine.sampling import SamplingParams
from test_engine import N_SEQ, peaked_target  # noqa: F401
from token_law import COLD_TEMPERATURE, STAT_NEW, STAT_PROMPT, check_token_law, decoder_law

K = 4
MAX_NEW = 24
PROMPTS3 = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8]]
WIDTHS = (0, 2, 4)


def test_controller_follows_acceptance_and_cost():
  """High acceptance by position and flat cost -> the widest width; the same acceptance with
  verification cost growing steeply with width -> w = 0 (plain decoding); acceptance that dies
  after the first positions (an n-gram drafter with short drafts) and a mildly rising cost -> a
  short width, even though the few drafts it has are fully accepted. Per-sequence caps
  (`longest_useful`, the host loop) shorten a low-acceptance sequence's draft."""
  live = np.ones(2, bool)
  caps = np.full(2, K)
  flat, steep, mild = np.asarray([1.0, 1.0, 1.0]), np.asarray([1.0, 3.0, 6.0]), np.asarray([1.0, 1.15, 1.4])
  high = 0.9 ** np.arange(1, K + 1)
  assert WIDTHS[adapt.choose_width_np(high, caps, live, WIDTHS, flat)] == 4
  assert WIDTHS[adapt.choose_width_np(high, caps, live, WIDTHS, steep)] == 0
  short = np.asarray([0.6, 0.5, 0.05, 0.05])   # H100 batch 64, ngram_simple: tau 1.31 at n_max 2, 1.43 at 8
  assert WIDTHS[adapt.choose_width_np(short, caps, live, WIDTHS, mild)] == 2
  assert adapt.expected_gain(short, caps, live, WIDTHS).tolist() == pytest.approx([2.0, 2 * 2.1, 2 * 2.2])
  assert adapt.expected_gain(short, np.asarray([4, 1]), live, WIDTHS).tolist() == pytest.approx([2.0, 3.7, 3.8])
  n = np.asarray(adapt.longest_useful(jnp.asarray([0.9, 0.3]), jnp.full(2, K), 0.2))
  assert n[0] == 4 and 0 < n[1] < n[0], n
  ac = adapt.AdaptiveConfig(widths=WIDTHS, explore_rounds=1, optimism=0.0)   # optimism: its own test
  host = adapt.HostController(ac, 2, K, flat)
  host.state = dataclasses.replace(host.state, accepted=np.asarray([0.9, 0.3]) * 50, trials=np.full(2, 50.0))
  assert host.lengths(caps, live).tolist() == n.tolist()            # exploration round: the widest width
  host.rates.hits, host.rates.asked = np.asarray([1.0, 0.0, 0.0, 0.0]), np.ones(K)
  host.costs = mild
  assert host.lengths(caps, live).tolist() == [2, min(2, n[1])]     # then the width the estimates choose
  assert host.record()["segments"] == [[4, 1], [2, 1]]


def test_host_width_finishes_the_static_batch_soonest_at_learned_costs():
  """A static batch runs until its slowest sequence is done: with one sequence drafting well and one
  with nothing to draft (cap 0), drafting maximizes tokens per ms but finishes no sooner, so the host
  loop's rule (`choose_width_finish`) stays at width 0, and drafts once the sequence without drafts
  is nearly done; a drafting width must predict a clear gain (`with_margin`). Round costs start at their priors (width 0 at the plain step's cost), a host round
  run replaces its width's prior and scales the unseen widths by its measured / prior ratio; costs a
  config gives stay as given."""
  rates, live, costs = 0.9 ** np.arange(1, K + 1), np.ones(2, bool), np.asarray([1.0, 1.5, 2.0])
  caps = np.asarray([K, 0])
  assert WIDTHS[adapt.choose_width_np(rates, caps, live, WIDTHS, costs)] == 4
  assert WIDTHS[adapt.choose_width_finish(rates, caps, live, [10, 10], WIDTHS, costs)] == 0
  assert WIDTHS[adapt.choose_width_finish(rates, caps, live, [10, 2], WIDTHS, costs)] == 4
  # a margin: drafting predicted to finish 5 % sooner (tau 2.1 at twice the cost) is not worth it at 10 %
  even = np.asarray([0.5, 0.3, 0.2, 0.1])
  assert WIDTHS[adapt.choose_width_finish(even, [K, K], live, [10, 10], WIDTHS, [1.0, 1.9, 2.0])] == 4
  assert WIDTHS[adapt.choose_width_finish(even, [K, K], live, [10, 10], WIDTHS,
                                          adapt.with_margin(np.asarray([1.0, 1.9, 2.0]), WIDTHS, 0.1))] == 0
  rc = adapt.HostRoundCosts(WIDTHS, prior=[2.0, 2.2, 2.4], decay=0.5, plain_ms=0.5)
  assert rc.costs.tolist() == pytest.approx([0.5, 2.2, 2.4])
  rc.observe(2, 4.4)                           # a host round at width 2: twice its forward-only prior
  assert rc.costs.tolist() == pytest.approx([0.5, 4.4, 2.4 * 1.5])
  rc.observe(0, 12.0, rounds=8)                # a plain segment: 1.5 ms a step
  assert rc.costs[0] == pytest.approx(1.0)
  fixed = adapt.HostRoundCosts(WIDTHS, prior=[2.0, 2.2, 2.4], decay=0.5, learn=False)
  fixed.observe(2, 9.0)
  assert fixed.costs.tolist() == pytest.approx([2.0, 2.2, 2.4])


def test_update_estimates_acceptance_per_token_and_per_position():
  """Rounds that accept 3 of 4, then reject at the first token, move alpha the censored-geometric
  way (accepted / (accepted + rejections)); the batch-wide position rates count, per position, the
  live sequences accepted through it over those asked for it, a missing draft counting as a miss;
  positions nobody was asked for keep their estimate."""
  ac = adapt.AdaptiveConfig(prior_weight=0.0, decay=1.0)
  ast = dataclasses.replace(adapt.AdaptiveState.init(2, ac), accepted=jnp.zeros(2), trials=jnp.zeros(2))
  rates = adapt.PositionRates(K, ac)

  def round_(asked, dlen, n_acc, live):
    rates.observe_round(np.asarray(asked), np.asarray(n_acc), np.asarray(live))
    return adapt.update(ast, jnp.asarray(dlen), jnp.asarray(n_acc), jnp.asarray(live), decay=1.0)

  live = [True, False]
  ast = round_([4, 4], [4, 4], [3, 4], live)
  assert float(ast.alpha[0]) == pytest.approx(3 / 4)
  ast = round_([4, 4], [4, 4], [0, 4], live)
  assert float(ast.alpha[0]) == pytest.approx(3 / 5)
  assert rates.rates.tolist() == pytest.approx([0.5, 0.5, 0.5, 0.0])
  live = [True, True]
  ast = round_([2, 2], [0, 2], [0, 2], live)
  assert float(ast.alpha[0]) == pytest.approx(3 / 5)                # no draft: no evidence about alpha
  assert rates.asked.tolist() == [4, 4, 2, 2]
  assert rates.rates.tolist() == pytest.approx([0.5, 0.5, 0.5, 0.0])


@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 1.6, 2.2), (1.0, 50.0, 100.0)],
                         ids=["flat", "mild", "backs_off"])
def test_adaptive_greedy_is_lossless(tiny_llama, costs):
  """Device loop (draft model; device ngram_simple, whose acceptance is replayed) and host loop
  (ngram_simple), batch 3: greedy output identical to plain decoding whatever widths the controller
  picks; with prohibitive costs most rounds are plain decode steps (the draft model's drafts are
  verified only in the periodic exploration segments, the replayed drafter's never); with flat
  costs the device loop prunes every narrower width and is the fixed loop at the widest."""
  cfg, params = tiny_llama
  plain = generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW).tokens
  ac = adapt.AdaptiveConfig(widths=WIDTHS, costs=costs, segment_rounds=3, margin=0.0)   # segments; the rule alone
  drafters = [DraftModelDrafter(cfg=cfg, max_draft=K, weights=perturb(params, 0.05, seed=1)),
              NgramSimple(size_n=1, size_m=K),
              NgramSimpleDevice(size_n=1, size_m=K)]    # commit-free: width-0 segments are plain decode steps
  for d in drafters:
    res = speculative_generate(params, cfg, PROMPTS3, d, max_new_tokens=MAX_NEW, adaptive=ac)
    assert res.tokens == plain, d.name
    rec = res.stats.adaptive      # [width, rounds(, ms)] runs: they add up to the rounds the loop ran
    assert sum(s[1] for s in rec["segments"]) == max(res.stats.per_seq_rounds), rec
    replayed = getattr(d, "replayable", False)
    if d.on_device and costs[0] == costs[-1]:   # flat: one width left, no segments
      assert rec["widths"] == [WIDTHS[-1]] and rec["widths_timed"] == list(WIDTHS), rec
      assert rec["segments"] == [[WIDTHS[-1], max(res.stats.per_seq_rounds)]] and res.stats.gen_tokens > 0, rec
      continue
    assert rec["widths"] == list(WIDTHS) and rec["costs_ms"] == pytest.approx(costs)
    if d.on_device:   # the first rounds explore the widest width, unless every width is replayed
      assert rec["segments"][0][0] == (0 if replayed else WIDTHS[-1]), rec
    if costs[1] >= 50 and replayed:
      assert res.stats.gen_tokens == 0 and rec["segments"] == [[0, max(res.stats.per_seq_rounds)]], rec
    elif costs[1] >= 50:   # backs off; only the exploration segments verify drafts
      assert res.stats.gen_tokens <= 0.5 * res.stats.rounds * K, res.stats.format()
    else:
      assert res.stats.gen_tokens > 0, res.stats.format()


def test_adaptive_sampling_preserves_the_token_law(peaked_target):
  """The engine's chi-square test with adaptive drafting on (widths 0/2/3, mild costs)."""
  cfg, params = peaked_target
  v = cfg.vocab_size
  drafter = DraftModelDrafter(cfg=cfg, max_draft=3, weights=perturb(params, 0.05, seed=2))
  seeds = list(range(20_000, 20_000 + N_SEQ))
  prompts = [STAT_PROMPT] * N_SEQ
  shape = dict(temperature=1.0)
  exact = decoder_law(params, cfg, shape)
  sampling = SamplingParams.make(N_SEQ, seed=seeds, **shape)
  ac = adapt.AdaptiveConfig(widths=(0, 2, 3), costs=(1.0, 1.3, 1.4))
  spec = speculative_generate(params, cfg, prompts, drafter, max_new_tokens=STAT_NEW, sampling=sampling, adaptive=ac)
  assert spec.stats.gen_tokens > 0, spec.stats.format()
  plain = generate_plain(params, cfg, prompts, max_new_tokens=STAT_NEW, sampling=sampling)
  colder = generate_plain(params, cfg, prompts, max_new_tokens=STAT_NEW,
                          sampling=SamplingParams.make(N_SEQ, seed=seeds, temperature=COLD_TEMPERATURE))
  check_token_law(exact, v, spec.tokens, plain.tokens, colder.tokens, plain_fits=False,
                  what="adaptive speculative sampling")


def test_per_round_cost_drops_the_per_call_cost():
  """per_round_ms: runs costing a fixed 5 ms per call plus 2 (resp. 0.5) ms a round read 2 (0.5) ms
  a round whatever the call cost, passes interleaved; a run that stops before the long run's extra
  rounds reads its whole time per round."""
  calls = []

  def run(per, cap=None):
    def f(n):
      calls.append(per)
      ran = n if cap is None else min(n, cap)
      return 5.0 + per * ran, ran
    return f

  ms = adapt.per_round_ms([run(2.0), run(0.5), run(1.0, cap=4)], short=4, long=20, passes=3)
  assert ms.tolist() == pytest.approx([2.0, 0.5, 9.0 / 4])
  assert calls == [2.0, 2.0, 0.5, 0.5, 1.0, 1.0] * 3


def test_calibration_measures_every_width(tiny_llama):
  """calibrate: one positive, non-decreasing cost per width, cached for the same shape."""
  cfg, params = tiny_llama
  c = adapt.calibrate(params, cfg, 2, 64, (0, 1, 2), repeats=2)
  assert c.shape == (3,) and np.all(c > 0) and np.all(np.diff(c) >= 0)
  assert adapt.calibrate(params, cfg, 2, 64, (0, 1, 2)) is c


def test_warm_run_compiles_every_width_so_timed_runs_compile_nothing(tiny_llama):
  """A benchmark's warm-up (`warm_widths=True`) compiles the segment program of every width; a
  following run of the same shapes adds no compilation whatever widths its controller picks (the
  widths a short warm-up never chose used to compile inside the timed run: 0.035x of plain decoding
  at batch 64 on an H200). The warm-up leaves its inputs alone: the output is still lossless."""
  from specjax.engine.adaptive_loop import adaptive_run
  cfg, params = tiny_llama
  plain = generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW).tokens
  ac = adapt.AdaptiveConfig(widths=(0, 1, 2, 4), costs=(1.0, 1.1, 1.15, 1.2), segment_rounds=2)
  drafter = DraftModelDrafter(cfg=cfg, max_draft=K, weights=perturb(params, 0.05, seed=3))
  before = adaptive_run._cache_size()
  warm = speculative_generate(params, cfg, PROMPTS3, drafter, max_new_tokens=2, capacity=128, warm_widths=True,
                              adaptive=ac)
  compiled = adaptive_run._cache_size()
  assert compiled - before >= 1, (before, compiled)     # one program holds every width
  assert warm.tokens == [t[:2] for t in plain]
  res = speculative_generate(params, cfg, PROMPTS3, drafter, max_new_tokens=MAX_NEW, capacity=128, adaptive=ac)
  assert adaptive_run._cache_size() == compiled
  assert res.tokens == plain


def test_warm_run_replaces_the_calibration_by_timed_rounds(tiny_llama):
  """The device loop's warm-up times whole rounds at every width and caches them for this shape and
  drafter (one positive ms per round per width, kept as timed), so the timed run's controller uses
  them (on the widths they do not prune); a second drafter with the same widths is timed on its own
  (its rounds cost what its drafting costs: the costs were once shared by every chain drafter of a
  shape, so an MTP head ran on an n-gram drafter's timings); generation stays lossless."""
  cfg, params = tiny_llama
  plain = generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW).tokens
  ac = adapt.AdaptiveConfig(widths=(0, 1, 2, 4), segment_rounds=3)
  drafter = DraftModelDrafter(cfg=cfg, max_draft=K, weights=perturb(params, 0.05, seed=4))
  key = timing_key(RoundSpec(cfg=cfg, drafter=drafter), params, len(PROMPTS3), 128, ac)
  speculative_generate(params, cfg, PROMPTS3, drafter, max_new_tokens=2, capacity=128, warm_widths=True, adaptive=ac)
  measured = adapt._COSTS[key]
  assert key in adapt.TIMED and measured.shape == (4,) and np.all(measured > 0)
  other = NgramSimpleDevice(size_n=1, size_m=K)
  speculative_generate(params, cfg, PROMPTS3, other, max_new_tokens=2, capacity=128, warm_widths=True, adaptive=ac)
  other_key = timing_key(RoundSpec(cfg=cfg, drafter=other), params, len(PROMPTS3), 128, ac)
  assert other_key in adapt.TIMED and adapt._COSTS[key] is measured and adapt._COSTS[other_key] is not measured
  res = speculative_generate(params, cfg, PROMPTS3, drafter, max_new_tokens=MAX_NEW, capacity=128, adaptive=ac)
  assert res.tokens == plain
  rec = res.stats.adaptive   # the controller ran on the warm-up's timings, less the widths they prune
  kept, kept_costs = adapt.prune_widths(ac.widths_for(K), measured, ac.tie)
  assert len(rec["measured_ms"]) == 4 and rec["widths"] == list(kept)
  assert rec["costs_ms"] == pytest.approx(kept_costs.tolist())


def test_replay_counts_the_rounds_speculation_would_take():
  """Replayed acceptance (`adaptive_replay`) over three segments of a random stream equals walking
  the stream round by round: a round at width w starting at L ends at L + 1 + min(m_L, w), m_L the
  leading tokens of the drafter's proposal at L that the stream repeats; rounds at width w start
  while their w tokens are known, and the walk resumes where the last round ended."""
  rng = np.random.default_rng(0)
  drafter, widths, b = NgramSimpleDevice(size_n=1, size_m=K), (0, 1, 2, 4), 3
  history = rng.integers(0, 5, (b, 200)).astype(np.int32)
  first = np.asarray([10, 12, 15])
  rs = ReplayState.init(jnp.asarray(first, jnp.int32), len(widths))
  for hist_len in ([40, 30, 60], [90, 100, 61], [150, 160, 180]):
    rs = replay_segment(rs, drafter.propose_at, jnp.asarray(history), jnp.asarray(hist_len, jnp.int32), widths, K,
                        window=120, decay=1.0)
  drafts, lengths = map(np.asarray, drafter.propose_at(jnp.asarray(history), jnp.tile(jnp.arange(200), (b, 1))))
  for i in range(b):
    for wi, w in enumerate(widths):
      pos, rounds = int(first[i]), 0
      while pos < int(rs.known[wi, i]):
        m = 0
        while m < lengths[i, pos] and drafts[i, pos, m] == history[i, pos + m]:
          m += 1
        pos, rounds = pos + 1 + min(m, w), rounds + 1
      assert (rounds, pos) == (int(rs.rounds[wi, i]), int(rs.start[wi, i])), (i, w)
      assert float(rs.tokens[wi, i]) == pos - first[i]
  assert np.all(np.asarray(rs.rounds)[0] == np.asarray(rs.tokens)[0])      # width 0: one token per round


def test_device_controller_finishes_the_batch_soonest():
  """The device controller picks the width with the least cost x (rounds the slowest live sequence
  still needs): one sequence with nothing to look up keeps a batch at plain decoding when drafting
  costs more per round; alone, a well-predicted sequence drafts; a finished one does not count.
  Before anything is replayed every width predicts one token per round (plain decoding)."""
  costs = jnp.asarray([1.0, 1.2, 1.3, 1.6])                       # widths 0, 1, 2, 4
  tau = jnp.asarray([[1.0, 1.0], [1.9, 1.0], [2.6, 1.05], [3.6, 1.1]])   # [W, B]: sequence 1 never matches
  remaining = jnp.asarray([100, 100])
  pick = lambda live: int(adapt.choose_width_device(tau, jnp.asarray(live), remaining, costs))
  assert pick([True, True]) == 0
  assert pick([True, False]) == 3
  near = jnp.asarray([1.0, 1.02, 1.3, 1.6])                        # width 1 within 3% of plain decoding's time
  assert int(adapt.choose_width_device(tau, jnp.asarray([True, True]), remaining, near * jnp.asarray([1, 1.0, 1, 1]),
                                       tie=0.03)) == 1                # ties go to the wider width
  assert int(adapt.choose_width_device(tau, jnp.asarray([True, True]), remaining, near, tie=0.01)) == 0
  tokens, rounds = jnp.asarray([[20.0, 5.0], [30.0, 5.0]]), jnp.asarray([[20.0, 5.0], [10.0, 5.0]])  # [W=2, B]
  prior = adapt.tau_replayed(tokens, rounds, prior_rounds=5.0)
  pooled = 35.0 / 15.0
  assert np.asarray(prior)[1].tolist() == pytest.approx([(30 + 5 * pooled) / 15, (5 + 5 * pooled) / 10])
  none = adapt.tau_replayed(jnp.zeros((2, 2)), jnp.zeros((2, 2)), 8.0)
  assert np.all(np.asarray(none) == 1.0)
  geo = np.asarray(adapt.tau_geometric(jnp.asarray([0.5]), (0, 1, 3)))[:, 0]
  assert geo.tolist() == pytest.approx([1.0, 1.5, 1.875])


def test_pruned_widths_are_those_no_wider_width_matches_within_the_tie():
  """A width goes when some wider width costs at most (1 + tie) times as much per round; the widest
  always stays; with costs rising steeply nothing goes."""
  ws = (0, 1, 2, 4, 8)
  assert adapt.prune_widths(ws, [1.30, 1.20, 1.22, 1.168, 1.169], 0.03)[0] == (8,)        # batch 1 on an H100
  assert adapt.prune_widths(ws, [1.22, 1.44, 1.57, 1.79, 2.25], 0.03)[0] == ws             # batch 64
  kept, c = adapt.prune_widths(ws, [1.0, 1.02, 1.3, 1.6, 2.0], 0.03)
  assert kept == (1, 2, 4, 8) and c.tolist() == pytest.approx([1.02, 1.3, 1.6, 2.0])


def test_device_drafts_fill_the_width_when_verification_is_free(tiny_llama):
  """Device loop, flat costs: every round verifies at the widest width and every live sequence
  drafts all of it, whatever its acceptance (a shorter draft would save no verification work in
  the batched loop); the host loop's per-sequence cap (reach_min) still shortens low-acceptance
  drafts. Output stays lossless."""
  cfg, params = tiny_llama
  plain = generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW).tokens
  ac = adapt.AdaptiveConfig(widths=WIDTHS, costs=(1.0, 1.0, 1.0), segment_rounds=3)
  drafter = DraftModelDrafter(cfg=cfg, max_draft=K, weights=perturb(params, 0.3, seed=5))   # often wrong
  res = speculative_generate(params, cfg, PROMPTS3, drafter, max_new_tokens=MAX_NEW, adaptive=ac)
  assert res.tokens == plain
  st = res.stats
  assert st.acceptance_rate < 0.5, st.format()
  assert st.gen_tokens == K * st.rounds, st.format()
  n = np.asarray(adapt.longest_useful(np.asarray([0.2, 0.9]), np.full(2, K), ac.reach_min))
  assert n[0] < n[1] == K


def test_width_choice_is_optimistic_about_rarely_seen_positions():
  """The width choice reads acceptance plus optimism / sqrt(observations): one sequence's first 4
  rounds with no accepted draft (an n-gram drafter before the answer repeats anything) leave the
  wide width the better bet when a round at width 4 costs 1.5x one at width 0, while the same
  rate from 64 sequences x 4 rounds backs off to plain decoding. Costs as timed are kept as they
  are, also where width 0 costs more than wider widths (T = 1 on another attention path)."""
  ac = adapt.AdaptiveConfig(decay=1.0)
  costs = np.asarray([1.0, 1.3, 1.5])
  for batch, want in ((1, 4), (64, 0)):
    pr = adapt.PositionRates(K, ac)
    pr.add([0, 0, 0, 0], [4 * batch] * K)             # 4 rounds of the whole batch at width 4, nothing accepted
    live = np.ones(batch, bool)
    got = WIDTHS[adapt.choose_width_np(pr.optimistic(ac.optimism), np.full(batch, K), live, WIDTHS, costs)]
    assert got == want, (batch, pr.optimistic(ac.optimism))
    assert WIDTHS[adapt.choose_width_np(pr.rates, np.full(batch, K), live, WIDTHS, costs)] == 0
  timed = adapt.remember_costs(("test-key",), [3.2, 1.7, 2.4])
  assert timed.tolist() == pytest.approx([3.2, 1.7, 2.4])
  adapt.TIMED.discard(("test-key",)), adapt._COSTS.pop(("test-key",))


def test_width_zero_segments_of_a_commit_free_drafter_are_plain_decoding(tiny_llama):
  """With width 0 the only choice, the device ngram drafter (whose commit changes nothing) runs
  the plain decoding step: sampled output (T = 1) identical token for token to plain decoding's
  with the same seed, i.e. the same forward, sampler, key stream and emission."""
  cfg, params = tiny_llama
  sampling = lambda: SamplingParams.make(len(PROMPTS3), temperature=1.0, seed=7)
  plain = generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW, sampling=sampling()).tokens
  ac = adapt.AdaptiveConfig(widths=(0,), costs=(1.0,), segment_rounds=5, explore_rounds=3)
  res = speculative_generate(params, cfg, PROMPTS3, NgramSimpleDevice(size_n=1, size_m=K), max_new_tokens=MAX_NEW,
                             sampling=sampling(), adaptive=ac)
  assert res.tokens == plain
  assert res.stats.gen_tokens == 0 and {s[0] for s in res.stats.adaptive["segments"]} == {0}


def test_host_loop_rounds_without_drafts_are_plain_decoding_in_one_call(tiny_llama, monkeypatch):
  """Host loop (ngram_simple, a host drafter) with width 0 the only choice: every round asks no
  draft, so the rounds between exploring rounds run as plain decoding steps in one device call.
  Sampled output (T = 1) identical token for token to plain decoding's with the same seed (the
  same forward, sampler, key stream and emission), and no host-drafted round at all: the only
  device calls are one per shadow segment (a quarter of shadow_rounds, then shadow_rounds; none
  queued past the token budget)."""
  host_loop_module = importlib.import_module("specjax.engine.host_loop")
  cfg, params = tiny_llama
  sampling = lambda: SamplingParams.make(len(PROMPTS3), temperature=1.0, seed=11)
  plain = generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW, sampling=sampling()).tokens
  calls = {"host_step": 0, "plain_segment": 0}
  for name in calls:
    real = getattr(host_loop_module, name)
    def counted(*a, _real=real, _name=name, **kw):
      calls[_name] += 1
      return _real(*a, **kw)
    monkeypatch.setattr(host_loop_module, name, counted)
  ac = adapt.AdaptiveConfig(widths=(0,), costs=(1.0,), segment_rounds=5, explore_every=2)
  res = speculative_generate(params, cfg, PROMPTS3, NgramSimple(size_n=1, size_m=K), max_new_tokens=MAX_NEW,
                             sampling=sampling(), adaptive=ac)
  assert res.tokens == plain
  rounds = max(res.stats.per_seq_rounds)
  assert res.stats.gen_tokens == 0 and res.stats.adaptive["segments"] == [[0, rounds]], res.stats.adaptive
  first = max(ac.shadow_rounds // 4, 1)
  assert calls == {"host_step": 0, "plain_segment": 1 + -(-max(rounds - first, 0) // ac.shadow_rounds)}, (calls, rounds)


def test_host_drafting_overlaps_the_plain_segment_on_the_device(tiny_llama, monkeypatch):
  """Host loop with shadow drafts: each plain segment is dispatched before the host drafts its
  shadow draft, and the drafter's request begins (a suffix drafter's tries built) after the first
  segment is dispatched, so the host's work overlaps the device's steps instead of adding to
  them; the shadow draft is still the one from the tokens before the segment (it keeps matching,
  and the controller turns to drafting) and the greedy output is plain decoding's."""
  host_loop_module = importlib.import_module("specjax.engine.host_loop")
  cfg, params = tiny_llama
  events = []
  real_plain = host_loop_module.plain_segment

  def dispatched(*a, **kw):
    events.append("dispatch")
    return real_plain(*a, **kw)

  class Recorded(NgramSimple):
    def begin(self, prompts):
      events.append("begin")
      super().begin(prompts)

    def propose(self, histories, n_max):
      events.append(("propose", tuple(len(h) for h in histories)))
      return super().propose(histories, n_max)

  monkeypatch.setattr(host_loop_module, "plain_segment", dispatched)
  prompt = [PROMPTS3[0]]
  ac = adapt.AdaptiveConfig(widths=(0, K), costs=(1.0, 3.5), shadow_rounds=8)
  res = speculative_generate(params, cfg, prompt, Recorded(size_n=1, size_m=K), max_new_tokens=2 * MAX_NEW, adaptive=ac)
  assert res.tokens == generate_plain(params, cfg, prompt, max_new_tokens=2 * MAX_NEW).tokens
  assert events[:3] == ["dispatch", "begin", ("propose", (len(prompt[0]) + 1,))], events[:4]
  after = [e for e in events if e != "begin"]
  assert all(after[i + 1][0] == "propose" for i, e in enumerate(after[:-1]) if e == "dispatch"), events
  assert after.count("dispatch") >= 2                    # every segment's shadow draft after its dispatch
  assert any(w == K for w, _ in res.stats.adaptive["segments"][1:]), res.stats.adaptive


def test_host_loop_queues_the_next_plain_segment_while_shadow_drafts_find_nothing(tiny_llama, monkeypatch):
  """Host loop backing off with shadow drafts that find nothing (a drafter with no draft to offer):
  after the first segment each plain segment is queued on the device before the host waits for
  the one before it (the host reads a segment's tokens only once its successor is dispatched), so
  the device does not idle while the host works between segments; no segment is queued past the
  token budget, and the output (sampled, T = 1) is plain decoding's token for token."""
  host_loop_module = importlib.import_module("specjax.engine.host_loop")
  cfg, params = tiny_llama
  events = []
  real_plain, real_finish = host_loop_module.plain_segment, host_loop_module._finish_segment
  def recorded(event, real):
    return lambda *a, **kw: (events.append(event), real(*a, **kw))[1]
  monkeypatch.setattr(host_loop_module, "plain_segment", recorded("D", real_plain))
  monkeypatch.setattr(host_loop_module, "_finish_segment", recorded("F", real_finish))

  class NoDrafts(NgramSimple):
    def propose(self, histories, n_max):
      tokens, _, scores = super().propose(histories, n_max)
      return tokens, np.zeros(len(histories), np.int32), scores

  sampling = lambda: SamplingParams.make(len(PROMPTS3), temperature=1.0, seed=5)
  ac = adapt.AdaptiveConfig(widths=(0, K), costs=(1.0, 3.5), shadow_rounds=4)
  res = speculative_generate(params, cfg, PROMPTS3, NoDrafts(size_n=1, size_m=K), max_new_tokens=2 * MAX_NEW,
                             sampling=sampling(), adaptive=ac)
  assert res.tokens == generate_plain(params, cfg, PROMPTS3, max_new_tokens=2 * MAX_NEW, sampling=sampling()).tokens
  rounds = max(res.stats.per_seq_rounds)
  assert res.stats.adaptive["segments"] == [[0, rounds]], res.stats.adaptive
  n = events.count("D")
  assert n == 1 + -(-(rounds - 1) // ac.shadow_rounds) and events.count("F") == n, (events, rounds)
  assert "".join(events) == "DF" + "D" * (n > 1) + "DF" * (n - 2) + "F" * (n > 1), events


def test_host_loop_warm_up_compiles_the_plain_segment(tiny_llama):
  """A benchmark's warm-up (2 tokens, inside the first exploring rounds, so it never backs off)
  compiles the host loop's plain segment too: the timed run, which backs off to plain rounds
  (drafting at 50x the cost), compiles nothing, and its output equals plain decoding's."""
  from specjax.engine.loops import plain_rounds, plain_segment
  cache_sizes = lambda: (plain_segment._cache_size(), plain_rounds._cache_size())
  cfg, params = tiny_llama
  ac = adapt.AdaptiveConfig(widths=(0, 2), costs=(1.0, 50.0), segment_rounds=2, explore_rounds=4, shadow_rounds=0)
  kw = dict(capacity=128, adaptive=ac)
  warm = speculative_generate(params, cfg, PROMPTS3, NgramSimple(size_n=1, size_m=K), max_new_tokens=2,
                              warm_widths=True, **kw)
  assert {w for w, _ in warm.stats.adaptive["segments"]} == {2}, warm.stats.adaptive
  compiled = cache_sizes()
  res = speculative_generate(params, cfg, PROMPTS3, NgramSimple(size_n=1, size_m=K), max_new_tokens=MAX_NEW, **kw)
  assert res.tokens == generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW).tokens
  assert any(w == 0 for w, _ in res.stats.adaptive["segments"]), res.stats.adaptive
  assert cache_sizes() == compiled
  # costs learned (no config costs): the warm-up times the plain step once for the shape, with its
  # token budget lifted on copies; the timed run reuses it, width 0 priced as plain steps
  host_loop_module = importlib.import_module("specjax.engine.host_loop")
  learned = dict(capacity=128, adaptive=dataclasses.replace(ac, costs=None, shadow_rounds=32))
  timed_before = len(host_loop_module._PLAIN_MS)
  speculative_generate(params, cfg, PROMPTS3, NgramSimple(size_n=1, size_m=K), max_new_tokens=2, warm_widths=True,
                       **learned)
  assert len(host_loop_module._PLAIN_MS) == timed_before + 1
  compiled = cache_sizes()           # the segment's token window follows shadow_rounds: this warm-up compiled it
  res = speculative_generate(params, cfg, PROMPTS3, NgramSimple(size_n=1, size_m=K), max_new_tokens=MAX_NEW, **learned)
  assert len(host_loop_module._PLAIN_MS) == timed_before + 1 and cache_sizes() == compiled
  assert res.tokens == generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW).tokens
  rec = res.stats.adaptive
  assert rec["costs_ms"][0] != pytest.approx(rec["prior_ms"][0]), rec      # not the forward calibration's


def test_host_loop_explores_with_shadow_drafts(tiny_llama):
  """Host loop, batch 1, a host round at width 4 costing 3.5 plain steps: the prior acceptance says
  plain decoding, so the first rounds run as a plain segment, with a draft proposed before it and
  compared with the tokens it makes (never verified); the answer repeats, the shadow drafts match,
  and the controller turns to drafting. Greedy output equal to plain decoding's."""
  cfg, params = tiny_llama
  prompt = [PROMPTS3[0]]
  ac = adapt.AdaptiveConfig(widths=(0, K), costs=(1.0, 3.5), shadow_rounds=8)
  res = speculative_generate(params, cfg, prompt, NgramSimple(size_n=1, size_m=K), max_new_tokens=2 * MAX_NEW,
                             adaptive=ac)
  assert res.tokens == generate_plain(params, cfg, prompt, max_new_tokens=2 * MAX_NEW).tokens
  segs = res.stats.adaptive["segments"]
  assert segs[0][0] == 0 and any(w == K for w, _ in segs[1:]), segs          # plain first, then drafting
  assert res.stats.acc_tokens > 0, res.stats.format()


def test_rounds_without_drafts_count_against_drafting(tiny_llama):
  """Device loop, a drafter whose acceptance is estimated from its verified drafts (the draft model)
  but which drafts nothing (p_min 1: never that sure): a round with no draft where one was asked
  for counts as a rejection at its first position, so after each exploring segment the controller
  backs off to width 0 (rounds that gain one token at any width) for the rounds up to the next
  exploring segment, in one segment, instead of keeping the prior's acceptance and drafting on.
  Greedy output stays plain decoding's."""
  cfg, params = tiny_llama
  plain = generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW).tokens
  ac = adapt.AdaptiveConfig(widths=WIDTHS, costs=(1.0, 1.3, 1.6), segment_rounds=3, explore_rounds=2, explore_every=4)
  d = DraftModelDrafter(cfg=cfg, max_draft=K, weights=perturb(params, 0.05, seed=1))
  res = speculative_generate(params, cfg, PROMPTS3, d, max_new_tokens=MAX_NEW, adaptive=ac,
                             draft_params=DraftParams(n_max=K, p_min=1.0))
  assert res.tokens == plain
  segs = res.stats.adaptive["segments"]
  assert res.stats.gen_tokens == 0 and segs[0] == [WIDTHS[-1], ac.explore_rounds], segs
  assert all(r <= ac.explore_rounds for w, r in segs if w > 0), segs        # only the exploring rounds draft
  assert [w for w, _ in segs[:3]] == [WIDTHS[-1], 0, WIDTHS[-1]] and segs[1][1] == 3 * ac.segment_rounds, segs
