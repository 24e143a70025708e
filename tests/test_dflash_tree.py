"""DFlash trees (`dflash_tree`): the best-first tree against a numpy brute force (and against every
path when the budget is at most top_k), prefix-closed under ties; the speculator through the
registry with its limits; greedy rounds replayed from training's blocks (the window follows the
accepted tree paths) and greedy losslessness (batch 1 and 3); the exact token law under sampling."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.engine.decode import generate_plain
from specjax.drafters.base import DraftParams
from specjax.drafters.dflash import DFlashDrafter, concat_taps, init_dflash, save_dflash
from specjax.drafters.dflash_tree import DFlashTreeDrafter, best_first_tree
from specjax.engine.tree import n_candidates
from specjax.drafters.registry import ALL, make_speculator
from specjax.engine import speculative_generate
from specjax.models.decoder import logits_from_prenorm
from specjax.models.load import LoadedModel
from test_dflash import (DC, MAX_NEW, MIXED_NEW, N_SEQ, PROMPTS3, W, _ctx, _jit_blocks, _jit_init, _prefill, _taps,
                         trained)  # noqa: F401 (trained: the tiny drafter fixture)
from token_law import COLD_TEMPERATURE, N_GREEDY, STAT_PROMPT, check_token_law, decoder_law, mixed_sampling

DEPTH, TOP_K, BUDGET = 3, 2, 7          # DC's block drafts 3 positions; 7 of the 2 + 2 * 4 = 10 candidates

_jit_tree = jax.jit(best_first_tree, static_argnums=(1, 2))


def _tree_drafter(cfg, params, dparams, budget=BUDGET):
  return DFlashTreeDrafter(cfg=cfg, dc=DC, max_draft=budget, depth=DEPTH, top_k=TOP_K,
                           weights={"dflash": dparams, "target": params})


def _paths(tokens, parents) -> list[tuple[int, ...]]:
  """Root-to-node token paths of one tree; asserts every parent precedes its child."""
  paths = []
  for i, (t, p) in enumerate(zip(tokens.tolist(), parents.tolist())):
    assert -1 <= p < i, f"node {i} has parent {p}: not in topological order"
    paths.append((paths[p] if p >= 0 else ()) + (t,))
  return paths


def _score(logp, path) -> float:
  return float(sum(logp[d, t] for d, t in enumerate(path)))


def _reference_candidates(logp, top_k) -> dict[tuple[int, ...], float]:
  """The pool by brute force: level 1 = the top_k tokens of position 1; level l = the top_k best
  paths of level l-1 (all of them enumerated and sorted) extended by the top_k tokens of position l."""
  pool, frontier = {}, [()]
  for d in range(logp.shape[0]):
    top = np.argsort(-logp[d], kind="stable")[:top_k]
    level = {f + (int(t),): _score(logp, f + (int(t),)) for f in frontier for t in top}
    pool.update(level)
    frontier = sorted(level, key=lambda p: -level[p])[:top_k]
  return pool


# ----------------------------------------------------------------------------------------------
# the tree


@pytest.mark.parametrize("depth,top_k,budget", [(3, 3, 3), (3, 4, 4), (1, 5, 3), (3, 2, 7), (3, 3, 12), (3, 4, 36)])
def test_tree_is_the_best_paths_by_summed_log_prob(depth, top_k, budget):
  """For 16 random sets of per-position marginals over 6 tokens: the chosen nodes are exactly the
  `budget` best paths of the brute-force pool by summed log-probability, each node's score is its
  path's sum, parents precede children, no path twice; with budget <= top_k they are also the
  `budget` best of ALL paths of length <= depth (the beam loses nothing there)."""
  v, rows = 6, 16
  rng = np.random.default_rng(depth * 100 + top_k * 10 + budget)
  logp = np.asarray(jax.nn.log_softmax(jnp.asarray(2.0 * rng.standard_normal((rows, depth, v)), jnp.float32)))
  tokens, parents, scores = (np.asarray(x) for x in _jit_tree(jnp.asarray(logp), top_k, budget))
  assert tokens.shape == parents.shape == scores.shape == (rows, budget)
  for r in range(rows):
    paths = _paths(tokens[r], parents[r])
    assert len(set(paths)) == budget
    np.testing.assert_allclose(scores[r], [_score(logp[r], p) for p in paths], rtol=1e-5, atol=1e-5)
    pool = _reference_candidates(logp[r].astype(np.float64), top_k)
    assert len(pool) == n_candidates(depth, top_k)
    assert set(paths) == set(sorted(pool, key=lambda p: -pool[p])[:budget]), f"row {r}"
    if budget <= top_k:
      every = [p for d in range(1, depth + 1) for p in itertools.product(range(v), repeat=d)]
      assert set(paths) == set(sorted(every, key=lambda p: -_score(logp[r], p))[:budget]), f"row {r}"


@pytest.mark.parametrize("budget", [4, 5, 9])
def test_tied_scores_keep_the_tree_prefix_closed(budget):
  """Marginals with a certain token (log-prob 0: a child scores exactly as its parent) and uniform
  ones (many equal scores), with budgets that cut through groups of equal scores: the chosen nodes
  still form a tree (every parent chosen, before its children), every path is a pool candidate
  (the certain tokens 4 and 5 are no level-1 candidate, so a child whose parent was left out would
  read as a path outside the pool), and no unchosen candidate scores above a chosen node."""
  v, depth, top_k = 6, 3, 3

  def certain(tok):
    row = np.full(v, -1e4, np.float32)
    row[tok] = 0.0
    return row

  uniform = np.zeros(v, np.float32)
  cases = [np.stack([certain(2), certain(4), certain(5)]), np.stack([uniform, certain(4), certain(5)]),
           np.stack([uniform, uniform, uniform]), np.stack([certain(1), uniform, certain(5)])]
  logp = np.asarray(jax.nn.log_softmax(jnp.asarray(np.stack(cases)), axis=-1))
  tokens, parents, scores = (np.asarray(x) for x in _jit_tree(jnp.asarray(logp), top_k, budget))
  for r in range(len(cases)):
    paths = _paths(tokens[r], parents[r])
    pool = _reference_candidates(logp[r].astype(np.float64), top_k)
    assert len(set(paths)) == budget and set(paths) <= set(pool), (r, paths)
    np.testing.assert_allclose(scores[r], [pool[p] for p in paths], rtol=1e-5, atol=1e-5)
    left = [pool[p] for p in pool if p not in set(paths)]
    assert min(scores[r]) >= max(left) - 1e-5, (r, paths)


def test_registry_and_limits(tiny_llama, tmp_path):
  """`dflash_tree` loads a saved drafter through the registry with the options n_nodes (the node
  budget; by default min(32, the candidates), whatever n_max, which caps the depth at verification),
  depth / top_k / block_size; depth past block_size - 1 and a budget past the candidates
  are refused with what to change (without --head: for SmolLM2, the committed heads are named);
  the chain's logits are the first max_draft positions of the pass."""
  cfg, params = tiny_llama
  assert "dflash_tree" in ALL
  dp = init_dflash(cfg, DC, seed=3, target_params=params)
  w, _ = save_dflash(tmp_path / "dflash.safetensors", dp, cfg, DC)
  target = LoadedModel(name="t", cfg=cfg, params=params)
  make = lambda **opts: make_speculator("dflash_tree", target, head=str(w), draft_params=DraftParams(n_max=2),
                                        options={"dflash_tree": opts})
  d = make(n_nodes=20, depth=3, top_k=4)
  assert isinstance(d, DFlashTreeDrafter) and d.proposes_tree and d.name == "dflash_tree"
  assert (d.max_draft, d.max_depth, d.top_k, d.taps) == (20, 3, 4, (0, 1))
  assert make(depth=3, top_k=4).max_draft == 32 and make(depth=3, top_k=2).max_draft == 10
  assert make(depth=5, top_k=2, block_size=6).max_depth == 5
  with pytest.raises(ValueError, match=r"depth 4 must be in \[1, block_size - 1 = 3\]"):
    make(depth=4, top_k=4)
  with pytest.raises(ValueError, match=r"node budget n_nodes 37 must be in \[1, 36\]"):
    make(n_nodes=37, depth=3, top_k=4)
  with pytest.raises(ValueError, match=r"needs a trained DFlash drafter \(--head PATH\)$"):
    make_speculator("dflash_tree", target, draft_params=DraftParams(n_max=8))
  # for SmolLM2 the error names the committed heads (they are in this checkout)
  smol = LoadedModel(name="smollm2-135m-instruct", cfg=None, params=None)
  for name, asset in (("dflash_tree", "smollm2/dflash/dflash.safetensors"),
                      ("eagle3", "smollm2/eagle3/eagle3_head.safetensors"), ("mtp", "smollm2/mtp/mtp_head.safetensors")):
    with pytest.raises(ValueError, match=f"committed: --head .*assets/{asset}$"):
      make_speculator(name, smol)
  seqs = [[3, 1, 4, 1, 5], [9, 2, 6]]
  toks, lens, taps = _prefill(params, cfg, [s[:-1] for s in seqs])
  chain = DFlashDrafter(cfg=cfg, dc=DC, max_draft=2, weights=d.weights)
  st = _jit_init(chain, chain.params(), toks, lens, taps, W)
  last, tlen = jnp.asarray([s[-1] for s in seqs]), lens
  full = np.asarray(chain.logits(chain.params(), st, last, tlen, n_positions=3))
  assert full.shape == (2, 3, cfg.vocab_size)
  np.testing.assert_array_equal(np.asarray(chain.logits(chain.params(), st, last, tlen)), full[:, :2])


# ----------------------------------------------------------------------------------------------
# speculation


def test_greedy_rounds_replay_from_training_blocks(tiny_llama, trained):
  """Greedy `dflash_tree` speculation (10-node trees, depth 3) over three ragged prompts, 32 new
  tokens (contexts past the 8-position window): output equal to plain decoding, and per sequence
  exactly the rounds replayed from training's teacher-forced blocks (a round at anchor a builds the
  tree from the block's marginals at a, accepts the deepest node whose path is plain decoding's
  next tokens, moves to a + n + 1), with exactly as many nodes accepted at every depth. The replay
  sees the true context, so equal rounds mean every commit wrote the accepted path's features."""
  cfg, params = tiny_llama
  d = _tree_drafter(cfg, params, trained)
  spec = speculative_generate(params, cfg, PROMPTS3, d, max_new_tokens=MAX_NEW)
  longer = generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW + DEPTH + 1).tokens
  rounds, accepted = [], np.zeros(DEPTH, np.int64)
  for p, gen in zip(PROMPTS3, longer):
    row = np.asarray(p + gen, np.int32)
    toks = jnp.asarray(np.pad(row, (0, 2 * W - len(row)))[None])
    taps = _taps(params, cfg, toks, jnp.asarray([len(row)], jnp.int32), DC.taps)
    anchors = np.arange(len(p), len(p) + MAX_NEW)
    h = _jit_blocks(trained, params, cfg, DC, toks, concat_taps(taps["layers"]), jnp.asarray(anchors[None]))
    logp = jax.nn.log_softmax(logits_from_prenorm(params, cfg, h[0, :, 1:]), axis=-1)   # [A, K, V]
    tree_tok, tree_par, _ = (np.asarray(x) for x in _jit_tree(logp, TOP_K, BUDGET))
    n_rounds, emitted, a = 0, 1, len(p)
    while emitted < MAX_NEW:
      paths = _paths(tree_tok[a - len(p)], tree_par[a - len(p)])
      n = max([len(q) for q in paths if q == tuple(row[a + 1:a + 1 + len(q)].tolist())] + [0])
      accepted[:n] += 1
      emitted, a, n_rounds = emitted + n + 1, a + n + 1, n_rounds + 1
    rounds.append(n_rounds)
  st = spec.stats
  print(st.format())
  assert spec.tokens == [g[:MAX_NEW] for g in longer], "greedy tree speculation differs from plain decoding"
  assert list(st.per_seq_rounds) == rounds, (st.per_seq_rounds, rounds)
  assert list(st.accepted_by_pos) == accepted.tolist(), (st.accepted_by_pos, accepted)
  assert 0 < accepted[DEPTH - 1] and accepted[0] < sum(rounds), "need whole paths accepted and rejected roots"


def test_greedy_is_lossless_batch_1(tiny_llama, trained):
  """One prompt alone with n_max 2, below the drafter's depth 3 (nodes deeper than 2 are not
  verified): plain decoding's tokens, with paths of length 2 accepted and none longer."""
  cfg, params = tiny_llama
  d = _tree_drafter(cfg, params, trained)
  spec = speculative_generate(params, cfg, [PROMPTS3[1]], d, max_new_tokens=MAX_NEW, draft_params=DraftParams(n_max=2))
  assert spec.tokens == generate_plain(params, cfg, [PROMPTS3[1]], max_new_tokens=MAX_NEW).tokens
  st = spec.stats
  assert st.accepted_by_pos[1] > 0 and st.accepted_by_pos[2] == 0 and st.rounds < MAX_NEW, st.format()


def test_sampling_keeps_the_token_law(tiny_llama, trained):
  """One batch of three ragged greedy prompts and 1000 copies of one prompt sampled at temperature 1
  with top-k 5 / top-p 0.9, each with its own seed; the tree's candidates are deterministic (q = None):
  - greedy rows: exactly `generate_plain`'s tokens;
  - sampled rows: tree nodes accepted and rejected; the joint law of the first three tokens fits the
    exact law of plain sampling and agrees with plain samples (chi-square p >= 1e-4); the statistic
    rejects temperature 0.7."""
  cfg, params = tiny_llama
  prompts = PROMPTS3 + [STAT_PROMPT] * N_SEQ
  sampling = mixed_sampling(N_SEQ, first_seed=30_000)
  spec = speculative_generate(params, cfg, prompts, _tree_drafter(cfg, params, trained), max_new_tokens=MIXED_NEW,
                              sampling=sampling)
  plain = generate_plain(params, cfg, prompts, max_new_tokens=MIXED_NEW, sampling=sampling)
  assert spec.tokens[:N_GREEDY] == plain.tokens[:N_GREEDY], "greedy speculative output differs from plain decoding"
  st = spec.stats
  acc = sum(st.per_seq_acc_tokens[N_GREEDY:]) / max(sum(st.per_seq_gen_tokens[N_GREEDY:]), 1)
  tau = sum(st.per_seq_emitted[N_GREEDY:]) / max(sum(st.per_seq_rounds[N_GREEDY:]), 1)
  print(f"dflash_tree mixed batch: sampled acceptance per node {acc:.3f}, tau {tau:.2f}")
  assert 0.02 <= acc <= 0.5 and tau > 1.3, f"sampled rows: acceptance per node {acc:.3f}, tau {tau:.2f}"
  colder = generate_plain(params, cfg, prompts, max_new_tokens=MIXED_NEW,
                          sampling=mixed_sampling(N_SEQ, first_seed=30_000, temperature=COLD_TEMPERATURE))
  check_token_law(decoder_law(params, cfg), cfg.vocab_size, spec.tokens[N_GREEDY:], plain.tokens[N_GREEDY:],
                  colder.tokens[N_GREEDY:], what="speculative sampling (dflash_tree)")
