"""Adaptive drafting (specjax.adaptive): the controller's choices follow acceptance and cost, and
generation with it stays lossless (greedy identical to plain decoding; sampled output keeps the
target's law) on the device loop and the host loop, including rounds that back off to plain
decoding."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import perturb
from specjax import adaptive as adapt
from specjax.decode import generate_plain
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.ngram import NgramSimple
from specjax.engine import speculative_generate
from specjax.sampling import SamplingParams
from test_engine import N_SEQ, peaked_target  # noqa: F401
from token_law import COLD_TEMPERATURE, STAT_NEW, STAT_PROMPT, check_token_law, decoder_law

K = 4
MAX_NEW = 24
PROMPTS3 = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8]]
WIDTHS = (0, 2, 4)


def test_controller_follows_acceptance_and_cost():
  """High acceptance and flat cost -> the widest width; the same acceptance with verification
  cost growing steeply with width -> w = 0 (plain decoding); a sequence with low acceptance gets
  a shorter draft than one with high acceptance (device `longest_useful` and the host controller
  agree)."""
  live = np.ones(2, bool)
  n_max = np.full(2, K)
  flat, steep = np.asarray([1.0, 1.0, 1.0]), np.asarray([1.0, 3.0, 6.0])
  ones = np.ones(2)
  assert WIDTHS[adapt.choose_width_np([0.9, 0.9], ones, n_max, live, WIDTHS, flat, 0.2)] == 4
  assert WIDTHS[adapt.choose_width_np([0.9, 0.9], ones, n_max, live, WIDTHS, steep, 0.2)] == 0
  assert WIDTHS[adapt.choose_width_np([0.9, 0.9], ones, n_max, live, WIDTHS, steep, 0.2, explore=True)] == 2
  assert WIDTHS[adapt.choose_width_np([0.9, 0.3], ones, n_max, live, WIDTHS, flat, 0.2)] == 4
  n = np.asarray(adapt.longest_useful(jnp.asarray([0.9, 0.3]), jnp.full(2, K), 0.2))
  assert n[0] == 4 and 0 < n[1] < n[0], n
  host = adapt.HostController(adapt.AdaptiveConfig(widths=WIDTHS), 2, K, flat)
  host.state = adapt.AdaptiveState(accepted=np.asarray([0.9, 0.3]) * 50, trials=np.full(2, 50.0), yield_=ones)
  assert host.lengths(n_max, live).tolist() == n.tolist()


def test_update_estimates_per_token_acceptance():
  """Rounds that accept 3 of 4, then reject at the first token, move alpha the censored-geometric
  way: accepted / (accepted + rejections)."""
  ast = adapt.AdaptiveState(accepted=jnp.zeros(1), trials=jnp.zeros(1), yield_=jnp.ones(1))
  live = jnp.ones(1, bool)
  ast = adapt.update(ast, jnp.asarray([4]), jnp.asarray([4]), jnp.asarray([3]), live, decay=1.0)
  assert float(ast.alpha[0]) == pytest.approx(3 / 4)
  ast = adapt.update(ast, jnp.asarray([4]), jnp.asarray([4]), jnp.asarray([0]), live, decay=1.0)
  assert float(ast.alpha[0]) == pytest.approx(3 / 5)
  ast = adapt.update(ast, jnp.asarray([4]), jnp.asarray([0]), jnp.asarray([0]), live, decay=0.5)
  assert float(ast.alpha[0]) == pytest.approx(3 / 5) and float(ast.yield_[0]) == pytest.approx(0.5)


@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 1.6, 2.2), (1.0, 50.0, 100.0)],
                         ids=["flat", "mild", "backs_off"])
def test_adaptive_greedy_is_lossless(tiny_llama, costs):
  """Device loop (draft model) and host loop (ngram_simple), batch 3: greedy output identical to
  plain decoding whatever widths the controller picks; with prohibitive costs most rounds are
  plain decode steps (drafts are verified only in the periodic exploration segments)."""
  cfg, params = tiny_llama
  plain = generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW).tokens
  ac = adapt.AdaptiveConfig(widths=WIDTHS, costs=costs, segment_rounds=3)   # several segments per run
  drafters = [DraftModelDrafter(cfg=cfg, max_draft=K, weights=perturb(params, 0.05, seed=1)),
              NgramSimple(size_n=1, size_m=K)]
  for d in drafters:
    res = speculative_generate(params, cfg, PROMPTS3, d, max_new_tokens=MAX_NEW, adaptive=ac)
    assert res.tokens == plain, d.name
    if costs[1] >= 50:   # backs off; only the exploration segments verify drafts
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
  from specjax.engine import _adaptive_segment
  cfg, params = tiny_llama
  plain = generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW).tokens
  ac = adapt.AdaptiveConfig(widths=(0, 1, 2, 4), costs=(1.0, 1.1, 1.15, 1.2), segment_rounds=2)
  drafter = DraftModelDrafter(cfg=cfg, max_draft=K, weights=perturb(params, 0.05, seed=3))
  before = _adaptive_segment._cache_size()
  warm = speculative_generate(params, cfg, PROMPTS3, drafter, max_new_tokens=2, capacity=128, warm_widths=True,
                              adaptive=ac)
  compiled = _adaptive_segment._cache_size()
  assert compiled - before >= len(ac.widths_for(K)), (before, compiled)
  assert warm.tokens == [t[:2] for t in plain]
  res = speculative_generate(params, cfg, PROMPTS3, drafter, max_new_tokens=MAX_NEW, capacity=128, adaptive=ac)
  assert _adaptive_segment._cache_size() == compiled
  assert res.tokens == plain


def test_warm_run_replaces_the_calibration_by_timed_rounds(tiny_llama):
  """The device loop's warm-up times whole rounds at every width and caches them for this shape
  (one positive, non-decreasing ms per round per width), so the timed run's controller uses
  them; generation stays lossless."""
  cfg, params = tiny_llama
  plain = generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW).tokens
  ac = adapt.AdaptiveConfig(widths=(0, 1, 2, 4), segment_rounds=3)
  drafter = DraftModelDrafter(cfg=cfg, max_draft=K, weights=perturb(params, 0.05, seed=4))
  key = adapt.cost_key(params, cfg, len(PROMPTS3), 128, ac.widths_for(K))
  adapt._COSTS.pop(key, None)
  adapt._MEASURED.discard(key)
  speculative_generate(params, cfg, PROMPTS3, drafter, max_new_tokens=2, capacity=128, warm_widths=True, adaptive=ac)
  measured = adapt._COSTS[key]
  assert measured.shape == (4,) and np.all(measured > 0) and np.all(np.diff(measured) >= 0)
  assert adapt.calibrate(params, cfg, len(PROMPTS3), 128, ac.widths_for(K)) is measured
  res = speculative_generate(params, cfg, PROMPTS3, drafter, max_new_tokens=MAX_NEW, capacity=128, adaptive=ac)
  assert res.tokens == plain


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
  assert n[0] < n[1] == K and adapt.longest_useful(np.asarray([0.2]), np.full(1, K), ac.device_reach_min)[0] == K
