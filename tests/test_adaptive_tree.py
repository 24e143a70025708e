"""Adaptive node budgets for token trees (specjax.engine.adaptive_tree): a budget-w tree is the nodes
of rank < w of a wider one, the tally counts what each budget would have accepted from one round's
accepted path, the controller picks the budget from measured costs and that tally (down to rounds
that verify `last` alone), and generation with it stays lossless for eagle3_tree, dflash_tree and
draft_tree (greedy identical to plain decoding; sampled output keeps the target's law)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_LLAMA, chi2_two_sample, random_params
from specjax.drafters import speculator_spec
from specjax.drafters.base import DraftContext, DraftParams
from specjax.drafters.dflash_tree import best_first_tree
from specjax.engine import Verdict, adaptive as adapt, speculative_generate
from specjax.engine.adaptive_tree import BudgetTally, choose_budget
from specjax.engine.decode import generate_plain
from specjax.engine.generation import pad_prompts
from specjax.engine.loops import prefill_request
from specjax.engine.round import RoundInputs, RoundSpec
from specjax.engine.sampling import SamplingParams
from specjax.engine.tree import score_rank
from specjax.models.load import LoadedModel
from token_law import N_GREEDY, STAT_PROMPT, check_token_law, decoder_law, mixed_sampling

PROMPTS = [[1, 5, 9, 3, 5, 9, 3, 5], [2, 4, 6, 2, 4], [7, 7, 7, 7, 1, 2, 7, 7, 7]]
MAX_NEW = 24
NODES = 8                                 # every tree's node budget: the default ladder is 0, 4, 8
TREE = dict(depth=3, top_k=2, n_nodes=NODES)
COSTS = (1.0, 1.3, 1.5)                   # ms per round at budgets 0, 4, 8: a tree round costs more than plain

_jit_best_first = jax.jit(best_first_tree, static_argnums=(1, 2))


@pytest.fixture(scope="module")
def target():
  return LoadedModel(name="tiny", cfg=TINY_LLAMA, params=random_params(TINY_LLAMA, seed=0))


def _tree(name: str, target, tmp_path):
  """The registry's example of a tree speculator (random head; draft_tree: a perturbed copy of the
  target) with a budget of NODES nodes over 3 levels."""
  spec = speculator_spec.get(name)
  return spec.build(target, draft_params=DraftParams(n_max=NODES), **{**spec.example(target, tmp_path), **TREE})


def _paths(tokens, parents, keep) -> set[tuple[int, ...]]:
  """The root-to-node token paths of one tree's nodes where `keep` is true."""
  out: list[tuple[int, ...]] = []
  for t, p in zip(np.asarray(tokens).tolist(), np.asarray(parents).tolist()):
    out.append((out[p] if p >= 0 else ()) + (t,))
  return {out[i] for i in range(len(out)) if keep[i]}


def _rounds_at(record: dict) -> dict[int, int]:
  out: dict[int, int] = {}
  for w, n in record["segments"]:
    out[w] = out.get(w, 0) + n
  return out


# ----------------------------------------------------------------------------------------------
# the ladder, the ranks, the tally, the chooser


def test_tree_ladder_is_0_then_doubling_from_4_to_the_budget():
  """Trees choose among 0, 4, 8, .. and their own budget; chains keep 0, 1, 2, 4, ..; given widths win."""
  ac = adapt.AdaptiveConfig()
  assert ac.widths_for(32, tree=True) == (0, 4, 8, 16, 32)
  assert ac.widths_for(48, tree=True) == (0, 4, 8, 16, 32, 48)
  assert ac.widths_for(6, tree=True) == (0, 4, 6) and ac.widths_for(3, tree=True) == (0, 3)
  assert ac.widths_for(8) == (0, 1, 2, 4, 8)                       # chains keep theirs
  assert adapt.AdaptiveConfig(widths=(0, 2, 5)).widths_for(8, tree=True) == (0, 2, 5)


@pytest.mark.parametrize("depth,top_k", [(3, 2), (4, 3), (2, 5)])
def test_a_smaller_budget_is_the_best_ranked_nodes_of_a_wider_tree(depth, top_k):
  """For random per-position marginals (DFlash's tree; rounded so ties occur), the budget-w tree drafted
  over min(depth, w) positions is, path for path, the nodes of rank < w of the budget-b tree (the
  ranks `score_rank` gives); ranks are 0 .. b-1, ties to the lower index."""
  v, rows, b = 6, 16, top_k + (depth - 1) * top_k * top_k
  rng = np.random.default_rng(depth * 10 + top_k)
  logp = jax.nn.log_softmax(jnp.asarray(np.round(2 * rng.standard_normal((rows, depth, v))), jnp.float32))
  tok_b, par_b, score_b = (np.asarray(x) for x in _jit_best_first(logp, top_k, b))
  rank = np.asarray(score_rank(jnp.asarray(score_b)))
  assert all(sorted(r) == list(range(b)) for r in rank.tolist())
  for w in sorted({1, 2, 3, top_k, b // 2, b - 1}):
    tok_w, par_w, _ = (np.asarray(x) for x in _jit_best_first(logp[:, :min(depth, w)], top_k, w))
    for r in range(rows):
      assert _paths(tok_w[r], par_w[r], [True] * w) == _paths(tok_b[r], par_b[r], rank[r] < w), (w, r)


def test_eagle3_tree_budgets_are_its_best_ranked_nodes(target, tmp_path):
  """The EAGLE-3 tree drafter's own `propose_budget`, for a batch of 4 prompts: the budget-2 tree
  (2 levels drafted) and the budget-4 tree (3 levels) are the nodes of rank < 2 and < 4 of its
  budget-8 tree; budget 0 drafts nothing."""
  d = _tree("eagle3_tree", target, tmp_path)
  prompts = PROMPTS + [[4, 4, 1]]
  toks, lens = pad_prompts(prompts)
  b = len(prompts)
  dp = {k: jnp.asarray(a) for k, a in DraftParams(n_max=NODES).arrays(b, None).items()}
  inp = RoundInputs(params=target.params, dparams=d.params(), sampling=SamplingParams.make(b), dp=dp,
                    stop_ids=jnp.asarray([-1], jnp.int32), max_new=jnp.full((b,), 8, jnp.int32))
  carry = prefill_request(RoundSpec(cfg=target.cfg, drafter=d), inp, jnp.asarray(toks), jnp.asarray(lens),
                          capacity=64, history_len=64)
  st = carry.state
  ctx = DraftContext(last=st.last, history=st.history, hist_len=st.hist_len, target_len=st.cache.lengths,
                     n_max=dp["n_max"], p_min=dp["p_min"], temperature=jnp.zeros((b,)))
  propose = jax.jit(lambda n: d.propose_budget(d.params(), carry.dstate, ctx, n)[0], static_argnums=0)
  wide, none = propose(NODES), propose(0)
  assert none.tokens.shape == (b, 0) and not np.any(np.asarray(none.lengths))

  for n in (2, 4):
    narrow = propose(n)
    for r in range(b):
      assert _paths(narrow.tokens[r], narrow.parents[r], [True] * n) == _paths(
          wide.tokens[r], wide.parents[r], np.asarray(wide.rank[r]) < n), (n, r)
      assert sorted(np.asarray(narrow.rank[r]).tolist()) == list(range(n))


def _verdict(path_rank, n_acc, live):
  b = len(n_acc)
  z = jnp.zeros((b,), jnp.int32)
  return Verdict(n_accepted=jnp.asarray(n_acc, jnp.int32), next_token=z, n_verified=z, reach=z,
                 path=jnp.zeros((b, 1), jnp.int32), taps={}, live=jnp.asarray(live), n_out=z,
                 path_rank=None if path_rank is None else jnp.asarray(path_rank, jnp.int32))


def test_tally_counts_what_each_budget_would_have_accepted():
  """A round at budget 8 (ladder 0, 2, 4, 8) whose accepted paths carry node ranks [0, 3, 1] (the
  largest rank through each depth: 0, 3, 3 -> budget 2 keeps depth 1, budget 4 all three), [5, 0]
  and nothing accepted; a finished sequence counts nothing. Then a round at budget 2 shows budgets
  0 and 2 only (budgets above it are censored), and a budget-0 round shows budget 0. Decay scales
  tokens and rounds alike; tau is tokens per round shrunk toward the batch's."""
  widths = (0, 2, 4, 8)
  tally = BudgetTally.init(len(widths), 4)
  tally = tally.observe(widths, 8, _verdict([[0, 3, 1], [5, 0, -1], [-1, -1, -1], [0, 1, 2]], [3, 2, 0, 3],
                                            [True, True, True, False]))
  assert np.asarray(tally.tokens).tolist() == [[1, 1, 1, 0], [2, 1, 1, 0], [4, 1, 1, 0], [4, 3, 1, 0]]
  assert np.asarray(tally.rounds).tolist() == [[1, 1, 1, 0]] * 4
  tally = tally.observe(widths, 2, _verdict([[1, -1, -1], [0, 1, -1], [0, -1, -1], [0, -1, -1]], [1, 2, 1, 0],
                                            [True, True, True, True]))
  assert np.asarray(tally.tokens)[:, 1].tolist() == [2, 4, 1, 3] and np.asarray(tally.rounds)[:, 3].tolist() == [1, 1, 0, 0]
  tally = tally.observe(widths, 0, _verdict(None, [0, 0, 0, 0], [True] * 4))
  assert np.asarray(tally.rounds)[0].tolist() == [3, 3, 3, 2] and np.asarray(tally.tokens)[0].tolist() == [3, 3, 3, 2]
  half = tally.decayed(0.5)
  assert np.asarray(half.tokens).tolist() == (0.5 * np.asarray(tally.tokens)).tolist()
  tau = np.asarray(half.tau(prior_rounds=0.0))
  assert tau[0].tolist() == pytest.approx([1.0] * 4) and tau[3, :3].tolist() == pytest.approx([4.0, 3.0, 1.0])
  assert np.asarray(BudgetTally.init(4, 2).tau(8.0)).tolist() == [[1.0, 1.0]] * 4   # nothing shown: plain


@pytest.mark.parametrize("costs,want", [((1.0, 1.05, 1.1, 1.25, 1.6), 8), ((1.0, 1.9, 2.6, 3.8, 6.5), 0),
                                        ((1.0, 1.0, 1.0, 1.0, 1.0), 32)], ids=["batch8", "batch64", "flat"])
def test_chooser_picks_the_budget_from_measured_costs(costs, want):
  """Budgets 0, 4, 8, 16, 32 with 1.0 / 1.8 / 2.4 / 2.7 / 2.8 tokens per round tallied for every
  sequence: costs rising gently (batch 8 on an H100, assumed) -> budget 8 (2.4 / 1.1 tokens per ms,
  the most); steeply (batch 64) -> 0, rounds that verify `last` alone; flat -> the widest. The first
  segment explores the widest budget and every `explore_every`-th probes the budget above the choice."""
  widths, b = (0, 4, 8, 16, 32), 8
  tau = np.asarray([1.0, 1.8, 2.4, 2.7, 2.8])
  tally = BudgetTally(tokens=jnp.asarray(np.repeat(50 * tau[:, None], b, 1), jnp.float32),
                      rounds=jnp.full((len(widths), b), 50.0, jnp.float32))
  ac = adapt.AdaptiveConfig(explore_every=4, explore_rounds=2, segment_rounds=16)
  live, remaining, c = jnp.ones((b,), bool), jnp.full((b,), 100), jnp.asarray(costs, jnp.float32)
  pick = lambda seg: tuple(int(x) for x in choose_budget(tally, live, remaining, c, jnp.int32(seg), ac))
  assert pick(1) == (widths.index(want), 16)
  assert pick(0) == (len(widths) - 1, 2)
  assert pick(4) == (min(widths.index(want) + 1, len(widths) - 1), 2)


# ----------------------------------------------------------------------------------------------
# generation


@pytest.mark.parametrize("shadow", [True, False], ids=["shadow_trees", "probes"])
@pytest.mark.parametrize("name", ["draft_tree", "eagle3_tree", "dflash_tree"])
def test_greedy_is_lossless_and_budgets_follow_acceptance(name, shadow, target, tmp_path):
  """Batch 3, 24 new tokens, budgets 0 / 4 / 8 at 1.0 / 1.3 / 1.5 ms a round, segments of 3 rounds,
  every second one exploring: greedy output identical to plain decoding. draft_tree (here the target
  drafting for itself: its best path is always right) spends most rounds on trees; eagle3_tree and dflash_tree with
  random heads (useless) fall to plain rounds (budget 0) but for the exploring segments: the first,
  at the widest budget, and without shadow trees the probes one budget above the choice (with them,
  the plain chunks' shadow trees show every budget, and no later segment drafts)."""
  plain = generate_plain(target.params, target.cfg, PROMPTS, max_new_tokens=MAX_NEW).tokens
  ac = adapt.AdaptiveConfig(costs=COSTS, segment_rounds=3, explore_rounds=2, explore_every=2, shadow_drafts=shadow)
  if name == "draft_tree":
    from specjax.drafters.draft_model_tree import DraftModelTreeDrafter
    drafter = DraftModelTreeDrafter(cfg=target.cfg, depth=TREE["depth"], top_k=TREE["top_k"], n_nodes=NODES,
                                    weights=target.params)
  else:
    drafter = _tree(name, target, tmp_path)
  res = speculative_generate(target.params, target.cfg, PROMPTS, drafter, max_new_tokens=MAX_NEW,
                             draft_params=DraftParams(n_max=NODES), adaptive=ac)
  assert res.tokens == plain, name
  rec, total = res.stats.adaptive, max(res.stats.per_seq_rounds)
  rounds = _rounds_at(rec)
  print(name, rec, res.stats.format())
  assert rec["widths"] == [0, 4, NODES] and sum(rounds.values()) == total, rec
  assert rec["segments"][0][0] == NODES, rec
  if name == "draft_tree":
    assert rounds.get(0, 0) < total / 2 and res.stats.acceptance_rate > 0.1, (rec, res.stats.format())
  elif shadow:
    assert all(w == 0 for w, _ in rec["segments"][1:]) and rec["segments"][0] == [NODES, ac.explore_rounds], rec
  else:
    exploring = (rec["n_segments"] + 1) // 2
    assert sum(n for w, n in rounds.items() if w) <= ac.explore_rounds * exploring, rec
    assert any(w for w, _ in rec["segments"][1:]), rec          # probes after the first segment
    assert rounds[0] >= total / 2 and rec["replayed_tau"][1] < COSTS[1], rec


def test_sampling_keeps_the_token_law(target, tmp_path):
  """dflash_tree under adaptive budgets (segments of one round, every second one exploring, so the
  rounds switch between trees and budget 0), a batch of 3 greedy rows and 1000 rows of one prompt
  sampled at temperature 1 / top-k 5 / top-p 0.9 with their own seeds: greedy rows equal plain
  decoding; the joint law of the first three sampled tokens fits plain sampling's exact law and
  plain samples, and each later position's tokens agree with plain samples (chi-square p >= 1e-4)."""
  n_seq, new = 1000, 10
  prompts = PROMPTS + [STAT_PROMPT] * n_seq
  sampling = mixed_sampling(n_seq, first_seed=40_000)
  ac = adapt.AdaptiveConfig(costs=(1.0, 1.02, 1.04), segment_rounds=1, explore_rounds=1, explore_every=2)
  spec = speculative_generate(target.params, target.cfg, prompts, _tree("dflash_tree", target, tmp_path),
                              max_new_tokens=new, sampling=sampling, draft_params=DraftParams(n_max=NODES), adaptive=ac)
  plain = generate_plain(target.params, target.cfg, prompts, max_new_tokens=new, sampling=sampling).tokens
  assert spec.tokens[:N_GREEDY] == plain[:N_GREEDY]
  rounds = _rounds_at(spec.stats.adaptive)
  assert len(rounds) >= 2 and spec.stats.gen_tokens > 0, spec.stats.adaptive
  check_token_law(decoder_law(target.params, target.cfg), target.cfg.vocab_size, spec.tokens[N_GREEDY:],
                  plain[N_GREEDY:], plain_fits=False, what="adaptive tree sampling (dflash_tree)")
  a, p = np.asarray(spec.tokens[N_GREEDY:]), np.asarray(plain[N_GREEDY:])
  for pos in range(3, new):
    v = target.cfg.vocab_size
    stat, df, pv = chi2_two_sample(np.bincount(a[:, pos], minlength=v), np.bincount(p[:, pos], minlength=v))
    assert pv >= 1e-4, f"position {pos} differs from plain sampling (chi2 {stat:.1f}, df {df}, p {pv:.2g})"


def test_warm_run_times_every_budget_per_drafter(target, tmp_path):
  """The warm-up times whole rounds at every budget with the adaptive program itself and caches
  them per drafter (eagle3_tree's and dflash_tree's rounds differ; their ladders do not); the
  timed run chooses with them (not with the forward-only calibration, which is cached without the
  drafter), so it prunes the ladder as the warm-up did and compiles nothing, and generation stays
  lossless."""
  from specjax.engine.adaptive_loop import adaptive_run, timing_key
  d = _tree("eagle3_tree", target, tmp_path)
  other = _tree("dflash_tree", target, tmp_path)
  ac = adapt.AdaptiveConfig(segment_rounds=3)
  widths = ac.widths_for(NODES, tree=True)
  key = timing_key(RoundSpec(cfg=target.cfg, drafter=d), target.params, len(PROMPTS), 128, ac)
  assert key != timing_key(RoundSpec(cfg=target.cfg, drafter=other), target.params, len(PROMPTS), 128, ac)
  assert key != timing_key(RoundSpec(cfg=target.cfg, drafter=d), target.params, len(PROMPTS), 128,
                           dataclasses.replace(ac, shadow_drafts=False))       # another width-0 program
  adapt._COSTS.pop(key, None)
  adapt.TIMED.discard(key)
  kw = dict(max_new_tokens=MAX_NEW, capacity=128, draft_params=DraftParams(n_max=NODES), adaptive=ac)
  speculative_generate(target.params, target.cfg, PROMPTS, d, warm_widths=True, **{**kw, "max_new_tokens": 2})
  measured = adapt._COSTS[key]
  assert key in adapt.TIMED and measured.shape == (3,) and np.all(measured > 0), measured
  compiled = adaptive_run._cache_size()
  res = speculative_generate(target.params, target.cfg, PROMPTS, d, **kw)
  assert res.tokens == generate_plain(target.params, target.cfg, PROMPTS, max_new_tokens=MAX_NEW).tokens
  rec = res.stats.adaptive
  assert rec["measured_ms"] == pytest.approx(measured.tolist())
  kept, kept_costs = adapt.prune_widths(widths, measured, ac.tie)
  assert rec["widths"] == list(kept) and rec["costs_ms"] == pytest.approx(kept_costs.tolist()), rec
  assert adaptive_run._cache_size() == compiled
