"""Adaptive width-0 rounds as plain chunks (specjax.engine.plain_chunks): m plain decoding steps, the
drafter caught up once per chunk (32 steps; W+1 for the tree draft model), leave the target and the drafter where m width-0 rounds
leave them, for every drafter whose commit takes them (trees at budget 0, chains at width 0): the
same tokens, target cache and statistics, and the same next draft at the full width (a drafter that
missed an entry, or conditioned on the wrong features, drafts another tree or chain)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_LLAMA, random_params
from specjax.drafters import speculator_spec
from specjax.drafters.base import DeviceDrafter, Draft, DraftParams
from specjax.drafters.ngram_mod_device import NgramModDevice
from specjax.engine.decode import generate_plain
from specjax.engine.generation import pad_prompts
from specjax.engine.loops import prefill_request, rounds_at
from specjax.engine.plain_chunks import chain_shadow, chunk_steps, plain_chunks, supports
from specjax.engine.round import RoundInputs, RoundSpec, draft_context
from specjax.engine.sampling import SamplingParams
from specjax.engine.tree import max_depth_of
from specjax.models.load import LoadedModel

PROMPTS = [[1, 5, 9, 3, 5, 9, 3, 5], [2, 4, 6, 2, 4], [7, 7, 7, 7, 1, 2, 7, 7, 7]]
NODES = 8


@pytest.fixture(scope="module")
def target():
  return LoadedModel(name="tiny", cfg=TINY_LLAMA, params=random_params(TINY_LLAMA, seed=0))


@pytest.mark.parametrize("name", ["eagle3_tree", "dflash_tree", "draft_tree", "eagle3", "dflash", "mtp"])
def test_plain_chunks_leave_the_state_of_width_zero_rounds(name, target, tmp_path):
  spec = speculator_spec.get(name)
  tree = name.endswith("_tree")
  d = spec.build(target, draft_params=DraftParams(n_max=NODES if tree else 3),
                 **{**spec.example(target, tmp_path), **(dict(depth=3, top_k=2, n_nodes=NODES) if tree else {})})
  b = len(PROMPTS)
  toks, lens = pad_prompts(PROMPTS)
  dp = {k: jnp.asarray(a) for k, a in DraftParams(n_max=NODES).arrays(b, None).items()}
  leaves, treedef = jax.tree_util.tree_flatten(d.params())
  rng = np.random.default_rng(1)      # the examples' heads may zero what reads the context: noise on every weight
  noisy = [x + jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
           else x for x in leaves]
  inp = RoundInputs(params=target.params, dparams=jax.tree_util.tree_unflatten(treedef, noisy), sampling=SamplingParams.make(b), dp=dp,
                    stop_ids=jnp.asarray([-1], jnp.int32), max_new=jnp.full((b,), 100, jnp.int32))
  full = RoundSpec(cfg=target.cfg, drafter=d)
  zero = RoundSpec(cfg=target.cfg, drafter=d, width=0)
  assert supports(zero) and not supports(full)
  chunk = chunk_steps(zero)
  assert chunk == ((max_depth_of(d) + 1) if name == "draft_tree" else 32)
  m = 2 * chunk + 1                                                  # two whole chunks and one step
  carry = prefill_request(full, inp, jnp.asarray(toks), jnp.asarray(lens), capacity=128, history_len=128)
  by_rounds, ran_rounds = jax.jit(functools.partial(rounds_at, zero))(inp, m, carry)
  carry = carry_after_prefill = prefill_request(full, inp, jnp.asarray(toks), jnp.asarray(lens), capacity=128,
                                                 history_len=128)
  by_chunks, live, ran_chunks = jax.jit(functools.partial(plain_chunks, zero))(inp, m, carry)

  assert int(ran_rounds) == int(ran_chunks) == m and np.asarray(live).tolist() == [m] * b
  a, c = by_rounds.state, by_chunks.state
  assert np.array_equal(a.history, c.history) and np.array_equal(a.last, c.last)
  assert np.array_equal(a.cache.lengths, c.cache.lengths) and np.array_equal(a.n_out, c.n_out)
  for x, y in zip(jax.tree_util.tree_leaves(by_rounds.stats), jax.tree_util.tree_leaves(by_chunks.stats)):
    assert np.array_equal(x, y)                                           # rounds, tokens, acceptance counters

  propose = jax.jit(lambda cr: d.propose(inp.dparams, cr.dstate, draft_context(full, inp, cr.state))[0])
  want, got = propose(by_rounds), propose(by_chunks)
  for field in ("tokens", "parents", "n_nodes") if tree else ("tokens", "lengths"):
    assert np.array_equal(getattr(want, field), getattr(got, field)), field
  assert np.asarray(got.n_nodes if tree else got.lengths).min() > 0
  if name.startswith("dflash"):   # a random DFlash head's tree barely moves with the context: compare its marginals
    logits = jax.jit(lambda cr: d.logits(inp.dparams, cr.dstate, cr.state.last, cr.state.cache.lengths,
                                         n_positions=3))
    want_l, got_l = np.asarray(logits(by_rounds)), np.asarray(logits(by_chunks))
    np.testing.assert_allclose(got_l, want_l, rtol=1e-4, atol=1e-4)
    other = np.asarray(logits(carry_after_prefill))
    assert np.abs(other - want_l).max() > 1e-2            # the marginals do follow the window
  else:
    assert len(np.unique(np.asarray(got.tokens))) > 2, got.tokens


@pytest.mark.parametrize("shadow", [True, False], ids=["shadow_drafts", "exploring"])
@pytest.mark.parametrize("name", ["mtp", "eagle3", "dflash"])
def test_adaptive_chains_back_off_to_plain_chunks_losslessly(name, shadow, target, tmp_path):
  """Adaptive drafting with a chain drafter whose drafts cost far more than they give (widths 0 / 2 /
  3 at 1 / 50 / 100 ms): batch 3 greedy output identical to plain decoding; most rounds run at width
  0, as plain chunks. Without shadow drafts the exploring segments verify drafts; with them no round
  drafts (the prior's choice at these costs is plain decoding) and the shadow drafts were counted."""
  from specjax.engine import adaptive as adapt, speculative_generate
  spec = speculator_spec.get(name)
  d = spec.build(target, draft_params=DraftParams(n_max=3), **spec.example(target, tmp_path))
  ac = adapt.AdaptiveConfig(widths=(0, 2, 3), costs=(1.0, 50.0, 100.0), segment_rounds=4, explore_rounds=2,
                            explore_every=3, shadow_drafts=shadow)
  plain = generate_plain(target.params, target.cfg, PROMPTS, max_new_tokens=24).tokens
  res = speculative_generate(target.params, target.cfg, PROMPTS, d, max_new_tokens=24,
                             draft_params=DraftParams(n_max=3), adaptive=ac)
  assert res.tokens == plain, name
  rec = res.stats.adaptive
  at_zero = sum(n for w, n in rec["segments"] if w == 0)
  assert sum(n for _, n in rec["segments"]) == max(res.stats.per_seq_rounds), rec
  assert at_zero >= max(res.stats.per_seq_rounds) / 2, rec
  if shadow:
    assert rec["segments"] == [[0, at_zero]] and rec["shadow"]["accepted"] + rec["shadow"]["rejected"] > 0, rec
  else:
    assert any(w == 3 for w, _ in rec["segments"]) and rec["shadow"] is None, rec


def test_server_rounds_at_width_zero_leave_the_state_of_width_zero_rounds(target, tmp_path):
  """The server's `run_rounds` at width 0 with a chunk-committing drafter (MTP; it runs plain chunks
  there): over every slot and over two gathered slots, the tokens, per-round counts (one token a
  round) and the drafter's next full-width draft are those of the same number of width-0 rounds,
  and the tokens plain decoding's (greedy)."""
  from specjax.serve import slot_programs as programs
  spec = speculator_spec.get("mtp")
  d = spec.build(target, draft_params=DraftParams(n_max=3), **spec.example(target, tmp_path))
  b, m, rounds_max = len(PROMPTS), 9, 12
  toks, lens = pad_prompts(PROMPTS)
  dp = {k: jnp.asarray(a) for k, a in DraftParams(n_max=3).arrays(b, 3).items()}
  inp = RoundInputs(params=target.params, dparams=d.params(), sampling=SamplingParams.make(b), dp=dp,
                    stop_ids=jnp.asarray([-1], jnp.int32), max_new=jnp.full((b,), 40, jnp.int32))
  full, zero = RoundSpec(cfg=target.cfg, drafter=d), RoundSpec(cfg=target.cfg, drafter=d, width=0)
  fresh = lambda: prefill_request(full, inp, jnp.asarray(toks), jnp.asarray(lens), capacity=64, history_len=64)
  want, _ = jax.jit(functools.partial(rounds_at, zero))(inp, m, fresh())
  propose = jax.jit(lambda st, ds: d.propose(inp.dparams, ds, draft_context(full, inp, st))[0].tokens)
  plain = generate_plain(target.params, target.cfg, PROMPTS, max_new_tokens=m + 1).tokens
  carry = fresh()
  state, dstate, new, counts, done, ran, _ = programs.run_rounds(
      zero, target.params, inp.dparams, carry.state, carry.dstate, None, inp.sampling, dp, inp.stop_ids, inp.max_new,
      jnp.int32(m), rounds_max=rounds_max)
  assert int(ran) == m and np.asarray(counts)[0].tolist() == [[1] * b] * m + [[0] * b] * (rounds_max - m)
  assert np.array_equal(state.history, want.state.history) and np.array_equal(state.cache.lengths,
                                                                              want.state.cache.lengths)
  assert [list(r[:m]) for r in np.asarray(new)] == [p[1:] for p in plain]
  assert np.array_equal(propose(state, dstate), propose(want.state, want.dstate))
  rows = jnp.asarray([2, 0], jnp.int32)                        # two slots gathered, advanced and written back
  carry = fresh()
  masks = (programs.slot_leaves(carry.state, jax.tree_util.tree_map(lambda x: x[:1], carry.state)),
           programs.slot_leaves(carry.dstate, jax.tree_util.tree_map(lambda x: x[:1], carry.dstate)))
  state, dstate, new, counts, done, ran, _ = programs.run_rounds(
      zero, target.params, inp.dparams, carry.state, carry.dstate, rows, inp.sampling, dp, inp.stop_ids, inp.max_new,
      jnp.int32(m), rounds_max=rounds_max, masks=masks)
  assert [list(r[:m]) for r in np.asarray(new)] == [plain[2][1:], plain[0][1:]]
  assert np.array_equal(propose(state, dstate)[np.asarray(rows)], propose(want.state, want.dstate)[np.asarray(rows)])
  # with shadow drafts: the same tokens and drafter state; the chunk's shadow draft, at its first round, counts
  # what a verified round at the full width from the same state counts (positions observed, accepted)
  carry = fresh()
  state, dstate, new, counts, done, ran, _ = programs.run_rounds(
      zero, target.params, inp.dparams, carry.state, carry.dstate, None, inp.sampling, dp, inp.stop_ids, inp.max_new,
      jnp.int32(m), rounds_max=rounds_max, shadow=True)
  counts = np.asarray(counts)
  assert counts.shape == (5, rounds_max, b) and not counts[1:3].any()       # no verified drafts
  assert [list(r[:m]) for r in np.asarray(new)] == [p[1:] for p in plain]
  assert np.array_equal(propose(state, dstate), propose(want.state, want.dstate))
  verified, _ = jax.jit(functools.partial(rounds_at, full))(inp, 1, fresh())
  st = jax.device_get(verified.stats)
  rejected = st.rejected + st.rounds - st.gen_drafts
  assert counts[4, 0].tolist() == st.acc_tokens.tolist() and not counts[3:, 1:].any()
  assert counts[3, 0].tolist() == np.where(rejected > 0, np.maximum(st.gen_tokens, 1), st.acc_tokens).tolist()


def test_no_exploring_segment_when_the_batch_is_nearly_done(target, tmp_path):
  """Adaptive MTP without shadow drafts (acceptance estimated from verified drafts, refreshed by
  exploring segments at the widest width): with width 0 far cheaper, an exploring segment is due every third segment, but the
  one that would start with fewer than explore_rounds + segment_rounds tokens left to every sequence
  is skipped (its knowledge could change at most one more segment), so the rounds after the first
  exploring segment all run at width 0; output identical to plain decoding's. With tokens to spare
  the later exploring segment still runs."""
  from specjax.engine import adaptive as adapt, speculative_generate
  spec = speculator_spec.get("mtp")
  d = spec.build(target, draft_params=DraftParams(n_max=3), **spec.example(target, tmp_path))
  ac = adapt.AdaptiveConfig(widths=(0, 2, 3), costs=(1.0, 50.0, 100.0), segment_rounds=4, explore_rounds=2,
                            explore_every=3, shadow_drafts=False)
  for max_new, late_explore in ((16, False), (40, True)):
    res = speculative_generate(target.params, target.cfg, PROMPTS, d, max_new_tokens=max_new,
                               draft_params=DraftParams(n_max=3), adaptive=ac)
    assert res.tokens == generate_plain(target.params, target.cfg, PROMPTS, max_new_tokens=max_new).tokens
    segs = res.stats.adaptive["segments"]
    assert segs[0] == [3, ac.explore_rounds] and segs[1][0] == 0, segs
    assert any(w == 3 for w, _ in segs[1:]) == late_explore, (max_new, segs)


@dataclasses.dataclass(frozen=True)
class KnowsTheFuture(DeviceDrafter):
  """A test drafter whose draft is the target's own greedy continuation (plain decoding's output,
  given as `future` [B, F]: prompt then generated tokens), every token off by one until the sequence
  has made `wrong_until` tokens: acceptance that jumps from 0 to 1 mid-generation. Stateless beyond
  the prompt lengths; its commit takes plain chunks (`chunk_commit`)."""
  chunk_commit = True
  name = "knows_the_future"
  max_draft: int = 3
  wrong_until: int = 0
  future: Any = dataclasses.field(default=None, compare=False, hash=False)

  def params(self):
    return {"future": self.future}

  def init(self, dparams, prompt_tokens, prompt_lens, prefill_taps, capacity):
    return {"prompt_len": prompt_lens}

  def propose(self, dparams, dstate, ctx):
    future = dparams["future"]
    cols = jnp.minimum(ctx.hist_len[:, None] + jnp.arange(self.max_draft)[None, :], future.shape[1] - 1)
    tokens = jnp.take_along_axis(future, cols, axis=1)                                 # [B, K] after `last`
    early = (ctx.hist_len - dstate["prompt_len"] < self.wrong_until)[:, None]
    tokens = jnp.where(early, (tokens + 1) % TINY_LLAMA.vocab_size, tokens)
    return Draft(tokens=tokens, lengths=jnp.minimum(ctx.n_max, self.max_draft)), dstate

  def commit(self, dparams, dstate, result):
    return dstate


def knows_the_future(target, max_new: int, wrong_until: int) -> KnowsTheFuture:
  plain = generate_plain(target.params, target.cfg, PROMPTS, max_new_tokens=max_new + 8).tokens
  rows = [p + g for p, g in zip(PROMPTS, plain)]
  future = np.zeros((len(rows), max(map(len, rows)) + 8), np.int32)
  for i, r in enumerate(rows):
    future[i, :len(r)] = r
  return KnowsTheFuture(wrong_until=wrong_until, future=jnp.asarray(future))


@pytest.mark.parametrize("name", ["mtp", "eagle3", "dflash", "ngram_mod", "knows_the_future"])
def test_shadow_draft_counts_what_verifying_it_accepts(name, target, tmp_path):
  """A plain chunk's shadow draft (the drafter's full draft, compared with the tokens the chunk makes)
  counts, per sequence, the draft tokens a verified round at the full width from the same state
  accepts, and a rejection where that round rejects or has no draft to verify (greedy); the chunk
  leaves the drafter as a chunk without a shadow draft does (same next draft)."""
  if name == "knows_the_future":
    d, n_max, dp_kw = knows_the_future(target, 16, wrong_until=0), 3, {}
  elif name == "ngram_mod":
    d, n_max = NgramModDevice(n_match=1, n_min=1, n_max=4, table_size=1 << 12), 4
  else:
    spec = speculator_spec.get(name)
    d, n_max = spec.build(target, draft_params=DraftParams(n_max=3), **spec.example(target, tmp_path)), 3
  b = len(PROMPTS)
  toks, lens = pad_prompts(PROMPTS)
  outcomes = []
  # then the second sequence drafts nothing (n_max 0) and the third's model drafts fall under p_min, cut by n_min
  for setting in (DraftParams(n_max=n_max), DraftParams(n_max=[n_max, 0, n_max], n_min=[0, 0, 1], p_min=[0, 0, 0.9])):
    dp = {k: jnp.asarray(a) for k, a in setting.arrays(b, None).items()}
    inp = RoundInputs(params=target.params, dparams=d.params(), sampling=SamplingParams.make(b), dp=dp,
                      stop_ids=jnp.asarray([-1], jnp.int32), max_new=jnp.full((b,), 40, jnp.int32))
    full, zero = RoundSpec(cfg=target.cfg, drafter=d), RoundSpec(cfg=target.cfg, drafter=d, width=0)
    fresh = lambda: prefill_request(full, inp, jnp.asarray(toks), jnp.asarray(lens), capacity=128, history_len=128)
    verified, _ = jax.jit(functools.partial(rounds_at, full))(inp, 1, fresh())
    st = verified.stats
    m = n_max + 2
    shadow = chain_shadow(inp.dp, b)
    shadowed, live, ran, (acc, rej) = jax.jit(functools.partial(plain_chunks, zero, shadow=shadow))(inp, m, fresh())
    plain, _, _ = jax.jit(functools.partial(plain_chunks, zero))(inp, m, fresh())
    assert np.asarray(acc).tolist() == np.asarray(st.acc_tokens).tolist(), (name, setting)
    no_draft = (np.asarray(st.rounds) - np.asarray(st.gen_drafts)) * (np.asarray(dp["n_max"]) > 0)
    assert np.asarray(rej).tolist() == (np.asarray(st.rejected) + no_draft).tolist(), (name, setting)
    if not outcomes:
      assert np.asarray(st.gen_drafts).sum() > 0, name          # the first setting verified drafts
    assert np.array_equal(shadowed.state.history, plain.state.history)
    propose = jax.jit(lambda cr: d.propose(inp.dparams, cr.dstate, draft_context(full, inp, cr.state))[0].tokens)
    assert np.array_equal(propose(shadowed), propose(plain))
    outcomes.append((np.asarray(acc).tolist(), np.asarray(rej).tolist()))
  if name == "knows_the_future":               # the whole draft accepted, nothing rejected
    assert outcomes == [([3] * b, [0] * b), ([3, 0, 3], [0, 0, 0])]
  elif name != "ngram_mod":
    assert outcomes[1][1][2] == 1                              # a draft cut by n_min counts as rejected


def test_shadow_drafts_turn_to_drafting_without_exploring(target):
  """Adaptive drafting with a chain drafter whose drafts are all wrong for the first 20 tokens and all
  right after: the first segment (exploring; with shadow drafts the prior's choice, drafting at these
  costs) sees acceptance 0 and the loop backs off to width 0; with shadow drafts it turns to the
  widest width once they match, without an exploring segment (`explore_every` is never reached), and
  finishes in fewer rounds; without them it stays at width 0.
  Greedy output identical to plain decoding's either way."""
  from specjax.engine import adaptive as adapt, speculative_generate
  max_new = 64
  d = knows_the_future(target, max_new, wrong_until=20)
  plain = generate_plain(target.params, target.cfg, PROMPTS, max_new_tokens=max_new).tokens
  runs = {}
  for shadow in (True, False):
    ac = adapt.AdaptiveConfig(widths=(0, 3), costs=(1.0, 1.2), segment_rounds=4, explore_rounds=2,
                              explore_every=10 ** 6, shadow_drafts=shadow)
    res = speculative_generate(target.params, target.cfg, PROMPTS, d, max_new_tokens=max_new,
                               draft_params=DraftParams(n_max=3), adaptive=ac)
    assert res.tokens == plain, shadow
    runs[shadow] = res.stats.adaptive
  on, off = runs[True], runs[False]
  assert on["segments"][:2] == [[3, 2], [0, on["segments"][1][1]]] and off["segments"][0] == [3, 2]
  assert all(w == 0 for w, _ in off["segments"][1:]), off
  assert on["segments"][-1][0] == 3 and sum(n for w, n in on["segments"] if w == 3) > 2, on
  assert sum(n for _, n in on["segments"]) < sum(n for _, n in off["segments"])
  assert on["shadow"]["accepted"] > 0 and on["shadow"]["rejected"] > 0 and off["shadow"] is None


@pytest.mark.parametrize("name", ["eagle3_tree", "dflash_tree", "draft_tree", "self_tree"])
def test_shadow_tree_tallies_what_verifying_it_accepts(name, target, tmp_path):
  """A plain chunk's shadow tree (the drafter's tree at its full node budget, walked along the tokens
  the chunk makes) adds to every node budget's tally the tokens a verified round at the full budget
  from the same state adds (greedy; `self_tree`: the target drafting for itself, so the best path is
  accepted to the tree's depth); the chunk leaves the drafter as a chunk without it does."""
  from specjax.drafters.draft_model_tree import DraftModelTreeDrafter
  from specjax.engine import adaptive as adapt
  from specjax.engine.adaptive_tree import BudgetTally, rounds_tallied
  if name == "self_tree":
    d = DraftModelTreeDrafter(cfg=target.cfg, depth=3, top_k=2, weights=target.params)
  else:
    spec = speculator_spec.get(name)
    d = spec.build(target, draft_params=DraftParams(n_max=NODES),
                   **{**spec.example(target, tmp_path), **dict(depth=3, top_k=2, n_nodes=NODES)})
  b, depth = len(PROMPTS), max_depth_of(d)
  toks, lens = pad_prompts(PROMPTS)
  widths = adapt.AdaptiveConfig().widths_for(d.max_draft, tree=True)
  dp = {k: jnp.asarray(a) for k, a in DraftParams(n_max=NODES).arrays(b, None).items()}
  inp = RoundInputs(params=target.params, dparams=d.params(), sampling=SamplingParams.make(b), dp=dp,
                    stop_ids=jnp.asarray([-1], jnp.int32), max_new=jnp.full((b,), 40, jnp.int32))
  full, zero = RoundSpec(cfg=target.cfg, drafter=d), RoundSpec(cfg=target.cfg, drafter=d, width=0)
  fresh = lambda: prefill_request(full, inp, jnp.asarray(toks), jnp.asarray(lens), capacity=128, history_len=128)
  empty = BudgetTally.init(len(widths), b)
  widest = dataclasses.replace(full, width=d.max_draft)
  _, verified, _ = jax.jit(functools.partial(rounds_tallied, widest, widths=widths))(inp, 1, fresh(), empty)
  observe = lambda tally, tree, made, steps, start: tally.observe_shadow(widths, tree, inp.dp, made, steps, depth)
  m = depth + 1
  shadowed, _, _, tally = jax.jit(functools.partial(plain_chunks, zero, shadow=(empty, observe)))(inp, m, fresh())
  plain, _, _ = jax.jit(functools.partial(plain_chunks, zero))(inp, m, fresh())
  assert np.array_equal(tally.tokens, verified.tokens) and np.array_equal(tally.rounds, verified.rounds), name
  if name == "self_tree":
    assert np.asarray(tally.tokens)[-1].tolist() == [1.0 + depth] * b
  assert np.array_equal(shadowed.state.history, plain.state.history)
  propose = jax.jit(lambda cr: d.propose(inp.dparams, cr.dstate, draft_context(full, inp, cr.state))[0].tokens)
  assert np.array_equal(propose(shadowed), propose(plain))
