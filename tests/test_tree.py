"""Tree verification: the tree sampler's law (exact, small vocabulary), KV compaction of the accepted
path, and lossless greedy / sampled tree-speculative generation with the `draft_tree` drafter."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import chi2_gof, place_fused, standard_normal
from specjax.engine.decode import generate_plain
from specjax.drafters.draft_model_tree import DraftModelTreeDrafter, level_sizes
from specjax.engine import RoundInputs, RoundSpec, speculative_generate, verify_tree
from specjax.engine.generation import GenState
from specjax.models.decoder import forward
from specjax.models.hybrid_config import HybridConfig
from specjax.engine.sampling import SamplingParams, init_keys
from specjax.models.kv_cache import KVCache
from specjax.engine.tree import TreeDraft, accept_tree, tree_shape
from token_law import COLD_TEMPERATURE, N_GREEDY, STAT_PROMPT, check_token_law, decoder_law, mixed_sampling

# ----------------------------------------------------------------------------------------------
# the tree sampler alone: an abstract target over a 5-token vocabulary

V = 5
PARENTS = [-1, -1, -1, 0, 0, 1, 3, 3, 4]         # 3 root children, 2 + 1 grandchildren, 3 at depth 3
DEPTH = 3
M = DEPTH + 1                                     # tokens compared: path + bonus, then plain sampling
ONE_HOT_TOKENS = [2, 0, 2, 1, 3, 4, 3, 0, 1]      # node 2 repeats node 0's token (a tried token: p' = 0)
N_DRAWS = 60_000


def _target_table(seed=0):
  """p(. | context) for every context of length < M: peaked Dirichlet rows (so drafts are sometimes
  accepted, sometimes not)."""
  rng = np.random.default_rng(seed)
  return {ctx: rng.dirichlet(np.full(V, 0.6)) for n in range(M) for ctx in itertools.product(range(V), repeat=n)}


def _draft_table(seed=1):
  """q(. | context, node): each node draws its token from its own distribution at its parent."""
  rng = np.random.default_rng(seed)
  return {(ctx, j): rng.dirichlet(np.full(V, 1.0)) for j in range(len(PARENTS))
          for ctx in itertools.product(range(V), repeat=_node_depth(j) - 1)}


def _flat(table):
  """A context table as an array [n_contexts, V], rows in order of `_code`."""
  rows = sorted(table, key=lambda ctx: (len(ctx), ctx))
  return np.stack([table[ctx] for ctx in rows])


def _lex(cols: list[np.ndarray], n_rows: int) -> np.ndarray:
  """[n] lexicographic index of contexts given as token columns (the same length for every row)."""
  code = np.zeros(n_rows, np.int64)
  for c in cols:
    code = code * V + c
  return code


def _code(cols: list[np.ndarray], n_rows: int) -> np.ndarray:
  """[n] row of `_flat` for contexts given as token columns."""
  return _lex(cols, n_rows) + sum(V ** i for i in range(len(cols)))


def _q_rows(q, j, tokens):
  """[n, V] node j's draft distribution at each row's context (its ancestors' tokens)."""
  table = np.stack([q[(ctx, j)] for ctx in itertools.product(range(V), repeat=_node_depth(j) - 1)])
  return table[_lex([tokens[:, a] for a in _ancestors(j)], tokens.shape[0])]


def _node_depth(j):
  return 1 if PARENTS[j] < 0 else 1 + _node_depth(PARENTS[j])


def _children(c, valid):
  return [j for j in range(len(PARENTS)) if PARENTS[j] == c and valid[j]]


def _target_law(p):
  """P(s_1..s_M) [V]*M of plain sampling."""
  law = np.zeros((V,) * M)
  for seq in itertools.product(range(V), repeat=M):
    law[seq] = np.prod([p[seq[:i]][seq[i]] for i in range(M)])
  return law


def _continue(p, ctx):
  """Law of the M-token sequence that starts with ctx and continues by plain sampling."""
  law = np.zeros((V,) * M)
  for rest in itertools.product(range(V), repeat=M - len(ctx)):
    law[ctx + rest] = np.prod([p[(ctx + rest)[:i]][(ctx + rest)[i]] for i in range(len(ctx), M)])
  return law


def _tree_law(p, q, valid, renormalize=True):
  """Exact law of [path, bonus, plain continuation] under recursive rejection over siblings, by
  enumerating every random choice (node tokens drawn from q, or fixed when q is None; accept /
  reject). `renormalize=False` is the classic mistake: a sibling is tried against the unchanged p'."""
  def at_node(c, ctx):                     # reached node c (root = -1) with context ctx
    return trying(c, ctx, p[ctx], _children(c, valid))

  def trying(c, ctx, resid, kids):
    if not kids:                           # bonus token from the final residual
      return sum(resid[x] * _continue(p, ctx + (x,)) for x in range(V) if resid[x] > 0)
    j, rest = kids[0], kids[1:]
    qj = np.eye(V)[ONE_HOT_TOKENS[j]] if q is None else q[(ctx, j)]
    left = np.maximum(resid - qj, 0.0)
    left = left / left.sum() if left.sum() > 0 else resid
    law = 0.0
    for x in range(V):
      if qj[x] == 0:
        continue
      a = min(1.0, resid[x] / qj[x])
      law = law + qj[x] * (a * at_node(j, ctx + (x,)) + (1 - a) * trying(c, ctx, left if renormalize else resid, rest))
    return law

  return at_node(-1, ())


def _sample_trees(q, n, rng):
  """Node tokens [n, T]: drawn from q at each node's context, or the fixed candidates."""
  t = len(PARENTS)
  tokens = np.zeros((n, t), np.int64)
  for j in range(t):
    if q is None:
      tokens[:, j] = ONE_HOT_TOKENS[j]
      continue
    probs = _q_rows(q, j, tokens)                                               # [n, V]
    cum = np.cumsum(probs, axis=1)
    tokens[:, j] = np.minimum((rng.random((n, 1)) > cum).sum(axis=1), V - 1)
  return tokens


def _ancestors(j):
  return [] if PARENTS[j] < 0 else _ancestors(PARENTS[j]) + [PARENTS[j]]


def _draw_with_jax(p, q, n, n_nodes, max_depth, seed):
  """Run `accept_tree` on n independent trees; returns M-token sequences [n, M] (path, bonus, then
  plain sampling on the host)."""
  rng = np.random.default_rng(seed)
  t = len(PARENTS)
  tokens = _sample_trees(q, n, rng)                                               # [n, T]
  node_ctx = [_code([tokens[:, a] for a in _ancestors(j) + [j]], n) for j in range(t)]
  p_flat = _flat(p)
  pt = np.concatenate([np.broadcast_to(p[()], (n, 1, V))] + [p_flat[c][:, None] for c in node_ctx], axis=1)   # [n, T+1, V]
  qt = None
  if q is not None:
    qt = np.stack([_q_rows(q, j, tokens) for j in range(t)], axis=1)                   # [n, T, V]
  tree = TreeDraft(tokens=jnp.asarray(tokens, jnp.int32), parents=jnp.asarray(np.broadcast_to(PARENTS, (n, t)), jnp.int32),
                   n_nodes=jnp.full((n,), n_nodes, jnp.int32), q=None if q is None else jnp.asarray(qt, jnp.float32))
  keys = jax.vmap(lambda s: jax.random.key_data(jax.random.key(s)))(jnp.arange(n, dtype=jnp.uint32) + seed)
  n_acc, path, nxt = (np.asarray(x) for x in _jit_accept(jnp.asarray(pt, jnp.float32), tree, keys, max_depth))
  out = np.full((n, M), -1, np.int64)
  for d in range(max_depth):
    on = n_acc > d
    out[on, d] = tokens[on, path[on, d]]
  out[np.arange(n), n_acc] = nxt
  for i in range(1, M):                                                           # plain sampling after the bonus
    todo = out[:, i] < 0
    probs = p_flat[_code([out[:, k] for k in range(i)], n)]                       # [n, V] (garbage where done)
    pick = np.minimum((rng.random((n, 1)) > np.cumsum(probs, axis=1)).sum(axis=1), V - 1)
    out[todo, i] = pick[todo]
  return out


@functools.partial(jax.jit, static_argnames=("max_depth",))
def _jit_accept(p, tree, keys, max_depth):
  return accept_tree(p, tree, tree_shape(tree.parents, tree.n_nodes, max_depth), keys, max_depth)


CASES = {"one_hot": (False, len(PARENTS), DEPTH), "sampled_q": (True, len(PARENTS), DEPTH),
         "one_hot_cut": (False, 8, 2), "sampled_q_cut": (True, 7, 2)}


@pytest.mark.parametrize("case", list(CASES))
def test_tree_sampler_law_is_the_target_law(case):
  """Recursive rejection over siblings on a tree with 3 / 2 / 1 siblings at depths 1-3, with fixed
  candidates (one-hot q, a repeated sibling token included) and with tokens drawn from per-node q;
  `_cut` variants also pass n_nodes and max_depth below the tree's (cut nodes are padding).
  - Exactly, by enumerating every random choice: the law of [accepted path, bonus token, plain
    continuation] equals the target's law (1e-12); trying siblings without renormalizing does not.
  - `accept_tree` itself, over 60k trees: the chi-square of the 4-token sequences against the exact
    law has p >= 1e-4; the same number of draws from the wrong procedure's law gets p < 1e-12."""
  use_q, n_nodes, max_depth = CASES[case]
  p = _target_table()
  q = _draft_table() if use_q else None
  valid = [j < n_nodes and _node_depth(j) <= max_depth for j in range(len(PARENTS))]
  target = _target_law(p)
  right = _tree_law(p, q, valid)
  wrong = _tree_law(p, q, valid, renormalize=False)
  assert abs(right.sum() - 1) < 1e-12 and abs(wrong.sum() - 1) < 1e-9
  np.testing.assert_allclose(right, target, rtol=0, atol=1e-12)
  assert np.abs(wrong - target).max() > 1e-3, "the check cannot see a missing renormalization"

  draws = _draw_with_jax(p, q, N_DRAWS, n_nodes, max_depth, seed=7)
  counts = np.bincount(np.ravel_multi_index(draws.T, (V,) * M), minlength=V ** M)
  _, df, p_ok = chi2_gof(counts, target)
  assert p_ok >= 1e-4, f"accept_tree's law differs from the target's (p={p_ok:.3g}, df={df})"
  bad = np.random.default_rng(3).multinomial(N_DRAWS, wrong.ravel() / wrong.sum())
  _, _, p_bad = chi2_gof(bad, target)
  assert p_bad < 1e-12, f"{N_DRAWS} draws cannot tell the wrong sampler from the right one (p={p_bad:.3g})"



# ----------------------------------------------------------------------------------------------
# one verification round on a real target: positions, mask, acceptance and KV compaction

ROUND_PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8]]
ROUND_CAP = 64


class _DepthBound:
  """The static facts `verify_tree` reads of a tree drafter: its node budget and depth bound."""
  proposes_tree, commit_free, taps = True, False, ()

  def __init__(self, max_draft, max_depth):
    self.max_draft, self.max_depth = max_draft, max_depth

  def __hash__(self):
    return hash((self.max_draft, self.max_depth))

  def __eq__(self, other):
    return isinstance(other, _DepthBound) and (self.max_draft, self.max_depth) == (other.max_draft, other.max_depth)


@functools.partial(jax.jit, static_argnames=("cfg", "max_depth"))
def _jit_tree_round(params, state, tree, sampling, *, cfg, max_depth):
  b, t = tree.tokens.shape
  dp = {"n_max": jnp.full((b,), t, jnp.int32), "n_min": jnp.zeros((b,), jnp.int32)}
  inp = RoundInputs(params=params, dparams=(), sampling=sampling, dp=dp, stop_ids=jnp.asarray([-1], jnp.int32),
                    max_new=jnp.full((b,), 32, jnp.int32))
  return verify_tree(RoundSpec(cfg=cfg, drafter=_DepthBound(t, max_depth)), inp, state, tree)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _jit_plain_forward(params, tokens, lens, *, cfg):
  return forward(params, cfg, tokens, KVCache.init(cfg, tokens.shape[0], ROUND_CAP), n_new=lens)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gemma"])
def test_tree_round_compacts_the_accepted_path(model, request):
  """One greedy round on a tree whose accepted path is nodes 1 -> 4 -> 6 (a wrong first child at
  depths 1 and 2, the right tokens also placed under rejected nodes, a wrong leaf at depth 4):
  3 accepted, the next token is the greedy one, and afterwards the cache equals a plain forward's
  over prompt + [last, path] in every committed slot (K and V, every layer; gemma: sliding layers
  of window 5 see the positions base + depth), with the lengths advanced by 4. The path handed to
  the drafter ([last, path]) and the hidden states gathered along it match the plain forward's."""
  cfg, params = request.getfixturevalue(model)
  b, width = len(ROUND_PROMPTS), 24
  lens = np.asarray([len(pr) for pr in ROUND_PROMPTS], np.int32)
  seqs = np.zeros((b, width), np.int32)
  for r, pr in enumerate(ROUND_PROMPTS):
    seqs[r, :len(pr)] = pr
  _, _, cache = _jit_plain_forward(params, jnp.asarray(seqs), jnp.asarray(lens), cfg=cfg)
  for i in range(5):                          # greedy continuation: last, g1..g4 (one compiled shape)
    logits, _, _ = _jit_plain_forward(params, jnp.asarray(seqs), jnp.asarray(lens + i), cfg=cfg)
    seqs[np.arange(b), lens + i] = np.asarray(logits)[np.arange(b), lens + i - 1].argmax(-1)
  greedy = [seqs[r, lens[r]:lens[r] + 5].tolist() for r in range(b)]
  sampling = SamplingParams.make(b)
  state = GenState(cache=cache, history=jnp.asarray(seqs), hist_len=jnp.asarray(lens + 1), prompt_len=jnp.asarray(lens),
                   last=jnp.asarray([g[0] for g in greedy], jnp.int32), keys=init_keys(sampling),
                   done=jnp.zeros((b,), bool))
  parents = [-1, -1, 0, 1, 1, 3, 4, 6]
  tree_tokens = []
  for g in greedy:
    g1, g2, g3, g4 = g[1:5]
    other = lambda x: (x + 1) % cfg.vocab_size
    tree_tokens.append([other(g1), g1, g2, other(g2), g2, g3, g3, other(g4)])
  tree = TreeDraft(tokens=jnp.asarray(tree_tokens, jnp.int32), parents=jnp.asarray([parents] * b, jnp.int32),
                   n_nodes=jnp.full((b,), len(parents), jnp.int32))
  before = np.asarray(state.cache.lengths)
  new, v = _jit_tree_round(params, state, tree, sampling, cfg=cfg, max_depth=4)
  n_acc, nxt, reach, on_path, tapped, n_out = v.n_accepted, v.next_token, v.reach, v.path, v.taps, v.n_out
  assert np.asarray(n_acc).tolist() == [3] * b and np.asarray(reach).tolist() == [4] * b
  assert np.asarray(nxt).tolist() == [g[4] for g in greedy]
  assert np.asarray(on_path).tolist() == [g[:4] + [0] for g in greedy]
  assert np.asarray(new.cache.lengths).tolist() == (before + 4).tolist()
  assert np.asarray(n_out).tolist() == [4] * b and np.asarray(new.last).tolist() == [g[4] for g in greedy]

  _, ref_taps, ref = _jit_plain_forward(params, jnp.asarray(seqs), jnp.asarray(lens + 4), cfg=cfg)
  for r in range(b):
    n = int(before[r]) + 4
    for got, want in zip(new.cache.k + new.cache.v, ref.k + ref.v):
      np.testing.assert_allclose(np.asarray(got)[r, :n], np.asarray(want)[r, :n], atol=2e-5, err_msg=f"row {r}")
    np.testing.assert_allclose(np.asarray(tapped["prenorm"])[r, :4], np.asarray(ref_taps["prenorm"])[r, n - 4:n],
                               atol=5e-5, err_msg=f"row {r}")


def test_hybrid_targets_refuse_tree_drafts():
  """Tree verification needs each node's recurrent state on hybrid targets, which is not built:
  a clear NotImplementedError, raised before anything runs."""
  cfg = HybridConfig(arch="qwen3_5", vocab_size=16, d_model=32, n_layers=2, layer_types=("linear", "full"),
                     n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64, lin_k_heads=1, lin_v_heads=2,
                     lin_k_dim=8, lin_v_dim=8)
  with pytest.raises(NotImplementedError, match="hybrid"):
    verify_tree(RoundSpec(cfg=cfg, drafter=_DepthBound(3, 3)), None, None, None)


# ----------------------------------------------------------------------------------------------
# tree-speculative generation with the `draft_tree` drafter

PROMPTS3 = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8]]
MAX_NEW = 24
TREE = dict(depth=3, top_k=2, width=2)           # 2 + 4 + 4 = 10 nodes
DRAFT_SIGMA = 0.2                                # draft = target + 20% noise


@pytest.fixture(scope="module")
def tree_drafter(tiny_llama):
  """A draft model near the target: every tensor plus DRAFT_SIGMA * max(std, 0.1) Gaussian noise
  (drawn with numpy: no per-leaf compilation; a fused projection's noise drawn for its parts side by
  side, `place_fused`, so the seed gives one draft model whatever the fused layout)."""
  cfg, params = tiny_llama
  rng = np.random.default_rng(1)
  place = place_fused(cfg)
  noisy = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.asarray(np.asarray(x) + DRAFT_SIGMA * max(float(np.std(x)), 0.1)
                                  * place(path, standard_normal(rng, path, x.shape).astype(np.float32))), params)
  return DraftModelTreeDrafter(cfg=cfg, weights=noisy, **TREE)


def test_draft_tree_layout(tree_drafter):
  """Level sizes k, min(w, n) * k, ...: 2 + 4 + 4 nodes, depth 3; registered as `draft_tree`."""
  from specjax.drafters.registry import ALL
  assert level_sizes(2, 2, 3) == (2, 4, 4) and level_sizes(3, 2, 3) == (3, 6, 6) and level_sizes(2, 5, 3) == (2, 4, 8)
  assert tree_drafter.max_draft == 10 and tree_drafter.max_depth == 3 and "draft_tree" in ALL


@pytest.mark.parametrize("which", ["batch1", "batch3_ragged"])
def test_greedy_tree_speculation_is_lossless(tiny_llama, tree_drafter, which):
  """Greedy tree-speculative decoding (10-node trees from a noisy draft model's top-2 expansion)
  returns exactly `generate_plain`'s tokens, for one prompt and a ragged batch of three; the trees
  are sometimes right and sometimes wrong (acceptance per node strictly inside (0, 1); every depth
  accepted sometimes, the deepest not always), and they save target passes."""
  cfg, params = tiny_llama
  prompts = PROMPTS3[:1] if which == "batch1" else PROMPTS3
  plain = generate_plain(params, cfg, prompts, max_new_tokens=MAX_NEW).tokens
  res = speculative_generate(params, cfg, prompts, tree_drafter, max_new_tokens=MAX_NEW)
  st = res.stats
  print(st.format())
  assert res.tokens == plain, "greedy tree speculation differs from plain decoding"
  assert 0.0 < st.acceptance_rate < 1.0 and len(st.acceptance_by_pos) == 3
  assert all(a > 0.0 for a in st.acceptance_by_pos) and st.acceptance_by_pos[-1] < 1.0, st.acceptance_by_pos
  assert st.rounds < sum(len(p) for p in plain) / 1.5, "tree speculation saved too few target passes"


N_SEQ = 1000


def test_sampled_tree_speculation_preserves_the_token_law(tiny_llama, tree_drafter):
  """One batch: the three ragged greedy prompts and 1000 copies of one prompt sampled at
  temperature 1 with top-k 5 / top-p 0.9, each with its own seed.
  - Greedy rows: exactly `generate_plain`'s tokens.
  - Sampled rows: some tree nodes accepted, some rejected; the joint law of the first three tokens
    fits the exact law of plain sampling and agrees with plain samples (chi-square p >= 1e-4); the
    statistic rejects temperature 0.7 (p < 1e-12), so it has power."""
  cfg, params = tiny_llama
  v = cfg.vocab_size
  prompts = PROMPTS3 + [STAT_PROMPT] * N_SEQ
  sampling = mixed_sampling(N_SEQ, first_seed=30_000)
  spec = speculative_generate(params, cfg, prompts, tree_drafter, max_new_tokens=12, sampling=sampling)
  plain = generate_plain(params, cfg, prompts, max_new_tokens=12, sampling=sampling)
  st = spec.stats
  assert spec.tokens[:3] == plain.tokens[:3], "greedy rows differ from plain decoding"
  acc = sum(st.per_seq_acc_tokens[3:]) / max(sum(st.per_seq_gen_tokens[3:]), 1)
  tau = sum(st.per_seq_emitted[3:]) / max(sum(st.per_seq_rounds[3:]), 1)
  assert 0.02 <= acc <= 0.5 and tau > 1.3, f"sampled rows: acceptance per node {acc:.3f}, tau {tau:.2f}"

  print(f"tree, sampled rows: acceptance {acc:.3f}, tau {tau:.2f}")
  colder = generate_plain(params, cfg, prompts, max_new_tokens=12,
                          sampling=mixed_sampling(N_SEQ, first_seed=30_000, temperature=COLD_TEMPERATURE))
  check_token_law(decoder_law(params, cfg), v, spec.tokens[N_GREEDY:], plain.tokens[N_GREEDY:],
                  colder.tokens[N_GREEDY:], what="tree speculation")


@pytest.mark.parametrize("max_depth", [None, 3, 8])
def test_tree_shape_is_the_parent_closure(max_depth):
  """Random trees in topological order (padding past n_nodes, an out-of-order parent treated as the
  root's child): validity, and the depth and ancestors of every valid node, equal a walk up the
  parent links in Python; every valid node's ancestors are valid."""
  rng = np.random.default_rng(3)
  b, t = 6, 16
  parents = np.full((b, t), -1, np.int64)
  for i in range(b):
    for j in range(1, t):
      parents[i, j] = rng.integers(-1, j)                           # a parent before the node, or the root
  parents[0, 5] = 9                                                  # out of order: hangs off the root
  n_nodes = rng.integers(1, t + 1, b)
  shape = jax.jit(lambda p, n: tree_shape(p, n, max_depth))(jnp.asarray(parents, jnp.int32),
                                                              jnp.asarray(n_nodes, jnp.int32))
  valid, depth, anc = (np.asarray(x) for x in (shape.valid, shape.depth, shape.ancestors))
  for i in range(b):
    for j in range(t):
      chain, u = [j], j
      while True:
        par = parents[i, u] if parents[i, u] < u else -1
        if par < 0:
          break
        chain.append(par)
        u = par
      want_valid = j < n_nodes[i] and (max_depth is None or len(chain) <= max_depth)
      assert valid[i, j] == want_valid, (i, j)
      if want_valid:
        assert depth[i, j] == len(chain) and set(np.flatnonzero(anc[i, j])) == set(chain), (i, j)
        assert all(valid[i, k] for k in chain)
