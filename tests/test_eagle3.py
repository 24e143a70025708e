"""EAGLE-3 heads: shapes, the draft vocabulary and the file format, the drafter's KV bookkeeping
across accept/reject rounds, the training-time test's view equal to chain and tree drafting, the
tree's shape, greedy losslessness (batch 1 and 3) and the exact token law under sampling with the
`eagle3` (chain) and `eagle3_tree` speculators."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_LLAMA
from specjax.engine.decode import generate_plain
from specjax.drafters.base import DraftContext, RoundResult
from specjax.drafters.eagle3 import Eagle3Config, build_d2t, head_module, head_step, init_head, load_head, save_head
from specjax.drafters.eagle3_drafter import Eagle3Drafter, Eagle3TreeDrafter, make_eagle3_drafter
from specjax.engine import speculative_generate
from specjax.models.decoder import forward, logits_from_prenorm
from specjax.models.load import LoadedModel
from specjax.models.kv_cache import KVCache
from specjax.train.eagle3 import Eagle3LossConfig, make_loss_fn, ttt_outputs
from specjax.train.loop import TrainConfig, train
from test_mtp import MIXED_NEW, N_SEQ, PROMPTS3
from token_law import N_GREEDY, STAT_PROMPT, check_token_law, decoder_law, mixed_sampling

K = 4
B = 8                       # batch of every hand-driven drafter call
W = 32                      # padded prompt width / cache capacity of those calls
VD = 12                     # draft vocabulary: 12 of the tiny target's 16 tokens
D2T_ROWS = [np.repeat(np.arange(16), np.arange(16, 0, -1))]   # token t appears 16 - t times
TAPS = Eagle3Config.make(TINY_LLAMA, VD).taps
TREE = dict(depth=3, top_k=3)
TREE_NODES = 10

_jit_init = jax.jit(lambda d, dp, toks, lens, taps, cap: d.init(dp, toks, lens, taps, cap), static_argnums=(0, 5))
_jit_propose = jax.jit(lambda d, dp, st, ctx: d.propose(dp, st, ctx), static_argnums=0)
_jit_tree = jax.jit(lambda d, dp, st, ctx: d.propose_tree(dp, st, ctx), static_argnums=0)
_jit_commit = jax.jit(lambda d, dp, st, res: d.commit(dp, st, res), static_argnums=0)
_jit_ttt = jax.jit(ttt_outputs, static_argnums=(1, 5))


@jax.jit
def _taps(params, toks, lens):
  cfg = TINY_LLAMA
  _, tapped, _ = forward(params, cfg, toks, KVCache.init(cfg, toks.shape[0], toks.shape[1]), n_new=lens, taps=TAPS)
  return tapped


def _hc():
  return Eagle3Config.make(TINY_LLAMA, VD)


def _d2t():
  return build_d2t(D2T_ROWS, TINY_LLAMA.vocab_size, VD)


def _weights(params, hp):
  return {"head": hp, "d2t": jnp.asarray(_d2t()), "target": params}


def _chain(params, hp, k=K):
  return Eagle3Drafter(hc=_hc(), max_draft=k, weights=_weights(params, hp))


def _tree(params, hp, nodes=TREE_NODES):
  return Eagle3TreeDrafter(hc=_hc(), max_draft=nodes, weights=_weights(params, hp), **TREE)


TRAIN_LOSS = Eagle3LossConfig(n_steps=3, batch_size=4)


@pytest.fixture(scope="module")
def trained_head(tiny_llama, tmp_path_factory):
  """A head trained for 80 steps with the training-time test on random token rows of the tiny
  target: right often enough, wrong often enough."""
  cfg, params = tiny_llama
  hc, d2t = _hc(), _d2t()

  def batch(step):
    rows = np.random.default_rng(step).integers(0, cfg.vocab_size, (4, 24)).astype(np.int32)
    return {"tokens": rows, "lens": np.full(4, 24, np.int32), "prompt_lens": np.zeros(4, np.int32)}

  loss_fn = make_loss_fn(hc, TRAIN_LOSS, jnp.dtype("float32"))
  tc = TrainConfig(steps=80, lr=1e-2, warmup_steps=10, log_every=60, ckpt_every=1000)
  res = train(loss_fn, init_head(hc, 1, target_params=params, d2t=d2t), {"target": params, "d2t": jnp.asarray(d2t)},
              batch, tc, tmp_path_factory.mktemp("eagle3_tiny"), progress=False)
  assert res.metrics["acc_0"] > 0.3, res.metrics
  return res.params


# ----------------------------------------------------------------------------------------------
# the head, the draft vocabulary, the file


def test_draft_vocabulary_is_the_most_frequent_tokens():
  """d2t holds the Vd most frequent tokens (ties to the smaller id) plus forced ones, ascending."""
  rows = [np.asarray([5, 5, 5, 1, 1, 9, 9, 3, 0]), np.asarray([7, 7, 7, 7])]
  assert build_d2t(rows, 12, 3).tolist() == [1, 5, 7]                      # 7 x4, 5 x3, then 1 and 9 tie: 1
  assert build_d2t(rows, 12, 4).tolist() == [1, 5, 7, 9]
  assert build_d2t(rows, 12, 4, always=[11]).tolist() == [1, 5, 7, 11]
  assert _d2t().tolist() == list(range(VD))


def test_head_shapes_and_step(tiny_llama):
  """Parameter shapes (fc 3D -> D, q/k/v from 2D, LM head D -> Vd), taps of a 2-layer target, and a
  head step writing its entries at each row's own slots."""
  cfg, params = tiny_llama
  hc = _hc()
  hp = init_head(hc, 0)
  d = cfg.d_model
  assert hc.tap_layers == (1, 0, 0) and hc.taps == (0, 1) and hc.tap_slots == (1, 0, 0)
  assert hp["fc"]["kernel"].shape == (d, 3 * d)
  assert hp["midlayer"]["self_attn"]["qkv_proj"]["kernel"].shape == ((cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, 2 * d)
  assert hp["lm_head"]["kernel"].shape == (VD, d)
  b, t, cap = 3, 5, 16
  rng = np.random.default_rng(0)
  emb, h = (jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32) for _ in range(2))
  cache = KVCache.init(hc.layer, b, cap).with_lengths(jnp.asarray([0, 2, 7]))
  pos = cache.lengths[:, None] + jnp.arange(t)[None, :]
  out, new = jax.jit(head_step, static_argnums=1)(hp, hc, emb, h, cache, pos, jnp.asarray([5, 3, 0]))
  assert out.shape == (b, t, d) and np.asarray(new.lengths).tolist() == [5, 5, 7]
  written = np.abs(np.asarray(new.k[0])).sum(axis=(2, 3)) > 0
  for r, start in enumerate([0, 2, 7]):
    assert written[r].tolist() == [start <= s < start + t for s in range(cap)]
  assert head_module(hp, hc).logits(out).shape == (b, t, VD)


def test_save_load_roundtrip(tiny_llama, tmp_path):
  """bf16 safetensors with EAGLE-3's tensor names ([out, in], q/k/v and gate/up unfused, d2t as
  offsets, t2d), back equal to the bf16-rounded originals; refused by a target of other sizes; the
  registry builds both speculators from the file."""
  from safetensors.numpy import load_file

  from specjax.drafters.registry import make_speculator
  from specjax.drafters.base import DraftParams
  cfg, params = tiny_llama
  hc, d2t = _hc(), build_d2t([np.asarray([0, 3, 3, 5, 9, 9, 9])], 16, VD)
  hp = init_head(hc, 3, target_params=params, d2t=d2t)
  w, _ = save_head(tmp_path / "h.safetensors", hp, d2t, hc, extra={"note": "x"})
  flat = load_file(str(w))
  assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.v_proj.weight", "lm_head.weight",
          "midlayer.mlp.gate_proj.weight", "midlayer.hidden_norm.weight", "norm.weight", "d2t", "t2d"} <= set(flat)
  assert flat["lm_head.weight"].shape == (VD, cfg.d_model)
  assert (flat["d2t"] + np.arange(VD)).tolist() == d2t.tolist() and flat["t2d"].sum() == VD
  back, d2t_back, hc_back, meta = load_head(w, cfg)
  assert hc_back == hc and d2t_back.tolist() == d2t.tolist() and meta["note"] == "x"
  ref = jax.tree_util.tree_map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16)), hp)
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(y), x), ref, back)
  with pytest.raises(ValueError, match="another target"):
    load_head(w, cfg.replace(d_model=48))
  target = LoadedModel(name="t", cfg=cfg, params=params)
  chain = make_speculator("eagle3", target, head=str(w), draft_params=DraftParams(n_max=3))
  tree = make_speculator("eagle3_tree", target, head=str(w), draft_params=DraftParams(n_max=3),
                         options={"eagle3_tree": {"depth": 2, "top_k": 3, "n_nodes": 9}})
  assert (type(chain), chain.max_draft, type(tree), tree.max_draft, tree.depth) == (Eagle3Drafter, 3, Eagle3TreeDrafter, 9, 2)
  assert tree.proposes_tree and not getattr(chain, "proposes_tree", False)
  # the node budget is the n_nodes option (n_max is a depth cap): by default min(32, the 3 + 3 * 3 candidates)
  default = make_speculator("eagle3_tree", target, head=str(w), draft_params=DraftParams(n_max=3),
                            options={"eagle3_tree": {"depth": 2, "top_k": 3}})
  assert default.max_draft == 12
  with pytest.raises(ValueError, match=r"node budget n_nodes 13 must be in \[1, 12\]"):
    make_speculator("eagle3_tree", target, head=str(w), options={"eagle3_tree": {"depth": 2, "top_k": 3, "n_nodes": 13}})


# ----------------------------------------------------------------------------------------------
# drafting: the cache across rounds, and training's view of it


def _ctx(seqs, target_len, p_min=0.0, n_max=K, temperature=0.0):
  b = len(seqs)
  hist = np.zeros((b, 2 * W), np.int32)
  for r, s in enumerate(seqs):
    hist[r, :len(s)] = s
  full = lambda x, dt: jnp.broadcast_to(jnp.asarray(x, dt), (b,))
  return DraftContext(last=jnp.asarray([s[-1] for s in seqs], jnp.int32), history=jnp.asarray(hist),
                      hist_len=jnp.asarray([len(s) for s in seqs], jnp.int32),
                      target_len=jnp.asarray(target_len, jnp.int32), n_max=full(n_max, jnp.int32),
                      p_min=full(p_min, jnp.float32), temperature=full(temperature, jnp.float32))


def _prefill(params, seqs):
  toks = np.zeros((len(seqs), W), np.int32)
  for r, s in enumerate(seqs):
    toks[r, :len(s)] = s
  lens = jnp.asarray([len(s) for s in seqs], jnp.int32)
  return jnp.asarray(toks), lens, _taps(params, jnp.asarray(toks), lens)


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_kv_cache_bookkeeping_across_rounds(tiny_llama, kind):
  """init -> (propose -> commit) x 4 by hand for 8 sequences with chosen outcomes (all rejected,
  some accepted, all accepted; one sequence finishes after round 2): after every commit the head's
  cache holds what a fresh `init` over the committed tokens holds (lengths, K/V in the committed
  slots, the pending fused taps), and the next draft equals the fresh state's. Trees: the accepted
  path is the greedy (first-child) path, as `verified` [last, path...] hands it over."""
  cfg, params = tiny_llama
  all_nodes = TREE["top_k"] + (TREE["depth"] - 1) * TREE["top_k"] ** 2      # every candidate: the greedy path is whole
  d = _chain(params, init_head(_hc(), 7)) if kind == "chain" else _tree(params, init_head(_hc(), 7), nodes=all_nodes)
  dp = d.params()
  rng = np.random.default_rng(1)
  seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (6, 2, 9, 3, 5, 7, 4, 8)]
  toks, lens, taps = _prefill(params, [s[:-1] for s in seqs])
  state = _jit_init(d, dp, toks, lens, taps, W)
  live = np.ones(B, bool)
  width = K if kind == "chain" else TREE["depth"]
  n_ctx = K if kind == "chain" else all_nodes

  def draft_of(st, ctx):   # -> [B, width] the tokens a fully accepted round would keep
    if kind == "chain":
      draft, st = _jit_propose(d, dp, st, ctx)
      return np.asarray(draft.tokens), st
    tokens, parents, _, _, st = _jit_tree(d, dp, st, ctx)
    tokens, parents = np.asarray(tokens), np.asarray(parents)
    path = np.zeros((B, width), np.int32)
    for r in range(B):   # first child at every level: node 0, then its first child, ...
      node, j = -1, 0
      while j < width:
        kids = np.nonzero(parents[r] == node)[0]
        node = int(kids[0])
        path[r, j] = tokens[r, node]
        j += 1
    return path, st

  for rnd in range(4):
    n_acc = rng.integers(0, width + 1, B)
    n_acc[rnd % B], n_acc[(rnd + 3) % B] = 0, width
    if rnd == 2:
      live[1] = False
    target_len = [len(s) - 1 for s in seqs]
    dt, state = draft_of(state, _ctx(seqs, target_len, n_max=n_ctx))
    verified = np.asarray([[s[-1]] + dt[r].tolist() for r, s in enumerate(seqs)], np.int32)
    _, _, ftaps = _prefill(params, [s[:-1] + verified[r].tolist() for r, s in enumerate(seqs)])
    cut = lambda x: jnp.asarray(np.stack([np.asarray(x)[r, t:t + width + 1] for r, t in enumerate(target_len)]))
    nxt = rng.integers(0, cfg.vocab_size, B)
    res = RoundResult(n_accepted=jnp.asarray(n_acc, jnp.int32), next_token=jnp.asarray(nxt, jnp.int32),
                      verified=jnp.asarray(verified), prenorm=cut(ftaps["prenorm"]),
                      layer_taps=tuple(cut(x) for x in ftaps["layers"]), live=jnp.asarray(live))
    state = _jit_commit(d, dp, state, res)
    for r in range(B):
      if live[r]:
        seqs[r] = seqs[r] + dt[r, :n_acc[r]].tolist() + [int(nxt[r])]
    rtoks, rlens, rtaps = _prefill(params, [s[:-1] for s in seqs])
    ref = _jit_init(d, dp, rtoks, rlens, rtaps, W)
    for r in range(B):
      n = len(seqs[r]) - 2
      assert int(state.cache.lengths[r]) == n, (rnd, r)
      for got, want in ((state.cache.k[0], ref.cache.k[0]), (state.cache.v[0], ref.cache.v[0])):
        np.testing.assert_allclose(np.asarray(got)[r, :n], np.asarray(want)[r, :n], atol=2e-5,
                                   err_msg=f"round {rnd} row {r}")
      np.testing.assert_allclose(np.asarray(state.pending)[r], np.asarray(ref.pending)[r], atol=2e-5)
    target_len = [len(s) - 1 for s in seqs]
    d_next, _ = draft_of(state, _ctx(seqs, target_len, n_max=n_ctx))
    d_ref, _ = draft_of(ref, _ctx(seqs, target_len, n_max=n_ctx))
    assert d_next.tolist() == d_ref.tolist()


def _ttt_probs(hp, params, rows, base):
  """Training's view: per row of token rows, the head's draft-vocabulary distributions of steps
  0..K-1 at base position `base` -> [R, K, Vd] (rows padded to TREE_NODES: one compilation)."""
  hc = _hc()
  toks = np.zeros((max(len(rows), TREE_NODES), W), np.int32)
  for r, s in enumerate(rows):
    toks[r, :len(s)] = s
  toks = jnp.asarray(toks)
  lens = jnp.asarray([len(s) for s in rows] + [1] * (toks.shape[0] - len(rows)), jnp.int32)
  outs = _jit_ttt(hp, hc, params, toks, _taps(params, toks, lens)["layers"], K)
  head = head_module(hp, hc)
  probs = [np.asarray(jax.nn.softmax(head.logits(o[:, base:base + 1])[:, 0], axis=-1)) for o in outs]
  return np.stack(probs, axis=1)[:len(rows)]


def test_training_time_test_drafts_what_the_chain_drafter_drafts(tiny_llama):
  """The training-time test's unrolled head (every base at once, the diagonal attention for the
  draft steps) gives, at the base the drafter starts from, the distributions the chain drafter
  drafts from: the same greedy chain, top-1 probabilities within 1e-5 (p_min just above step j's
  cuts the draft at j), and, for a sampled row, q equal to them mapped through d2t."""
  cfg, params = tiny_llama
  hp = init_head(_hc(), 5)
  d = _chain(params, hp)
  prompt, last = [3, 1, 4, 1, 5, 9, 2, 6], 7
  toks, lens, taps = _prefill(params, [prompt] * B)
  state = _jit_init(d, d.params(), toks, lens, taps, W)
  ctx = _ctx([prompt + [last]] * B, [len(prompt)] * B)
  draft, _ = _jit_propose(d, d.params(), state, ctx)
  chain = np.asarray(draft.tokens)[0].tolist()
  d2t = _d2t()
  probs = _ttt_probs(hp, params, [prompt + [last] + chain], len(prompt) - 1)[0]      # [K, Vd]
  assert [int(d2t[p.argmax()]) for p in probs] == chain
  hi = [float(probs[j].max()) + 1e-5 for j in range(K)]
  lo = [min(float(p.max()) for p in probs[:j + 1]) - 1e-5 for j in range(K)]
  dr, _ = _jit_propose(d, d.params(), state, dataclasses.replace(ctx, p_min=jnp.asarray(hi + lo, jnp.float32)))
  lengths = np.asarray(dr.lengths).tolist()
  assert all(lengths[j] <= j for j in range(K)) and all(lengths[K + j] >= j + 1 for j in range(K)), lengths
  sampled, _ = _jit_propose(d, d.params(), state, dataclasses.replace(ctx, temperature=jnp.full((B,), 1.0)))
  row = np.asarray(sampled.tokens)[0].tolist()
  q = np.asarray(sampled.q)[0]                                                          # [K, V]
  want = _ttt_probs(hp, params, [prompt + [last] + row], len(prompt) - 1)[0]
  np.testing.assert_allclose(q[:, d2t], want, atol=1e-5)
  assert np.all(np.delete(q, d2t, axis=1) == 0)


def test_training_time_test_scores_every_tree_node(tiny_llama):
  """Every node of a drafted tree scores the cumulative log-probability that the training-time test
  gives its root path (so each node's entry saw exactly its ancestors); the tree is topological,
  ancestor-closed, at most `depth` deep; children score below their parents; its greedy path is (a
  prefix of) the chain drafter's draft; every sequence gets the whole node budget, none where
  n_max is 0 (n_max caps the depth at verification)."""
  cfg, params = tiny_llama
  hp = init_head(_hc(), 6)
  tree, chain = _tree(params, hp), _chain(params, hp, k=TREE["depth"])
  prompt, last = [9, 2, 6, 5, 3, 5, 8], 1
  toks, lens, taps = _prefill(params, [prompt] * B)
  st = _jit_init(tree, tree.params(), toks, lens, taps, W)
  ctx = _ctx([prompt + [last]] * B, [len(prompt)] * B, n_max=[TREE_NODES] * 4 + [0, 1, 2, 10])
  tokens, parents, n_nodes, scores = (np.asarray(x) for x in _jit_tree(tree, tree.params(), st, ctx)[:4])
  tokens, parents, scores = tokens[0], parents[0], scores[0]
  assert np.asarray(n_nodes).tolist() == [TREE_NODES] * 4 + [0] + [TREE_NODES] * 3
  paths = []
  for i, par in enumerate(parents):
    assert -1 <= par < i
    paths.append((paths[par] if par >= 0 else []) + [int(tokens[i])])
    if par >= 0:
      assert scores[i] <= scores[par]
  assert max(len(p) for p in paths) <= TREE["depth"]
  d2t = _d2t()
  t2d = {int(t): i for i, t in enumerate(d2t)}
  probs = _ttt_probs(hp, params, [prompt + [last] + p for p in paths], len(prompt) - 1)
  for i, path in enumerate(paths):
    want = sum(np.log(probs[i, j, t2d[t]]) for j, t in enumerate(path))
    assert abs(want - scores[i]) < 1e-4, (i, path, want, scores[i])
  c_st = _jit_init(chain, chain.params(), toks, lens, taps, W)
  greedy, _ = _jit_propose(chain, chain.params(), c_st, _ctx([prompt + [last]] * B, [len(prompt)] * B))
  first = [0]                                       # the first child at every level, as deep as the budget kept it
  while (parents == first[-1]).any():
    first.append(int(np.nonzero(parents == first[-1])[0][0]))
  assert len(first) >= 2
  assert [int(tokens[i]) for i in first] == np.asarray(greedy.tokens)[0, :len(first)].tolist()


def test_engine_acceptance_is_the_training_time_tests_on_the_same_tokens(tiny_llama, trained_head):
  """End to end, training's metric is what the engine measures: on the engine's own greedy output
  (prompt + generated tokens as one teacher-forced row), the training-time test's hits (step j's
  draft-vocabulary argmax at base i, mapped through d2t, equals the target's argmax after
  position i + j + 1), replayed as chain rounds (a round at p drafts after p, accepts the longest
  run of hits, the next round starts after the bonus token), give exactly the engine's rounds and
  accepted drafts by position. A mismatch in what the head sees while drafting (taps and the
  tokens they pair with, rotary positions, the head's cache after partial acceptance, d2t) breaks
  the equality. (CPU, f32, measured the same on MT-bench q81-96 with the SmolLM2 head: 0.466 at
  n_max 1 both ways; the TTT accuracy there is ~0.5 against 0.72 on its training rows.)"""
  cfg, params = tiny_llama
  k, new = 3, 24
  d = _chain(params, trained_head, k=k)
  spec = speculative_generate(params, cfg, PROMPTS3, d, max_new_tokens=new)
  width = max(len(p) for p in PROMPTS3) + new
  toks = np.zeros((len(PROMPTS3), width), np.int32)
  for r, (p, out) in enumerate(zip(PROMPTS3, spec.tokens)):
    toks[r, :len(p) + len(out)] = p + out
  lens = jnp.asarray([len(p) + len(o) for p, o in zip(PROMPTS3, spec.tokens)], jnp.int32)
  _, tapped, _ = forward(params, cfg, jnp.asarray(toks), KVCache.init(cfg, len(PROMPTS3), width), n_new=lens,
                         taps=TAPS)
  want = np.asarray(jnp.argmax(logits_from_prenorm(params, cfg, tapped["prenorm"]), axis=-1))   # [R, L] after p
  outs = _jit_ttt(trained_head, _hc(), params, jnp.asarray(toks), tapped["layers"], k)
  head, d2t = head_module(trained_head, _hc()), _d2t()
  drafted = [d2t[np.asarray(jnp.argmax(head.logits(o), axis=-1))] for o in outs]          # step j at base i
  rounds, n_accepted = 0, np.zeros(k, int)
  for r, p0 in enumerate(len(p) for p in PROMPTS3):
    p, end = p0, int(lens[r]) - 1          # a round at p: last = x_p, target_len = p; base p - 1
    while p < end:
      rounds, n = rounds + 1, 0
      while n < min(k, end - p) and drafted[n][r, p - 1] == want[r, p + n]:
        n_accepted[n] += 1
        n += 1
      p += n + 1
  assert (spec.stats.rounds, spec.stats.accepted_by_pos) == (rounds, n_accepted.tolist())
  assert 0 < n_accepted[0] < rounds


# ----------------------------------------------------------------------------------------------
# losslessness


@pytest.fixture(scope="module", params=["chain", "tree"])
def drafter(request, tiny_llama, trained_head):
  _, params = tiny_llama
  return _chain(params, trained_head, k=3) if request.param == "chain" else _tree(params, trained_head)


MIXED_PROMPTS = PROMPTS3 + [STAT_PROMPT] * N_SEQ


def _mixed_sampling():
  return mixed_sampling(N_SEQ, first_seed=30_000)


@pytest.fixture(scope="module")
def plain_mixed(tiny_llama):
  """Plain decoding of the mixed batch (3 greedy rows, 1000 sampled ones), shared by the tests."""
  cfg, params = tiny_llama
  return generate_plain(params, cfg, MIXED_PROMPTS, max_new_tokens=MIXED_NEW, sampling=_mixed_sampling()).tokens


def test_greedy_speculation_is_lossless_batch_1(tiny_llama, drafter, plain_mixed):
  """Batch 1, greedy: exactly plain greedy decoding's tokens (those of the same prompt in the mixed
  batch: greedy rows do not depend on their batch), and speculation saved target passes."""
  cfg, params = tiny_llama
  spec = speculative_generate(params, cfg, [PROMPTS3[1]], drafter, max_new_tokens=MIXED_NEW)
  assert spec.tokens == [plain_mixed[1]]
  assert spec.stats.rounds < MIXED_NEW, spec.stats.format()


def test_speculation_is_lossless_batch_3_and_sampled(tiny_llama, drafter, plain_mixed):
  """One batch, two checks (one compilation): three ragged greedy prompts and 1000 copies of one
  prompt sampled at temperature 1 with top-k 5 / top-p 0.9, each with its own seed.
  - Greedy rows: exactly `generate_plain`'s tokens, with acceptance strictly between 0 and 1.
  - Sampled rows: the joint law of the first three tokens fits the exact law of plain sampling and
    agrees with plain samples (chi-square p >= 1e-4). The chain draws its drafts from the head's
    distribution and passes it as q; the tree's candidates are deterministic (q one-hot)."""
  cfg, params = tiny_llama
  v = cfg.vocab_size
  spec = speculative_generate(params, cfg, MIXED_PROMPTS, drafter, max_new_tokens=MIXED_NEW, sampling=_mixed_sampling())
  st = spec.stats
  assert spec.tokens[:3] == plain_mixed[:3], "greedy speculative output differs from plain decoding"
  acc3 = sum(st.per_seq_acc_tokens[:3]) / max(sum(st.per_seq_emitted[:3]), 1)
  assert 0.15 <= acc3 <= 0.95, f"greedy: {acc3:.3f} of the tokens were drafted ones; the head must be sometimes right"
  acc = sum(st.per_seq_acc_tokens[3:]) / max(sum(st.per_seq_emitted[3:]), 1)
  assert 0.1 <= acc <= 0.95, f"sampled: {acc:.3f} of the tokens were drafted ones"
  print(f"{drafter.name}: greedy drafted share {acc3:.3f}, sampled {acc:.3f}")
  check_token_law(decoder_law(params, cfg), v, spec.tokens[N_GREEDY:], plain_mixed[N_GREEDY:], plain_fits=False,
                  what=f"speculative sampling ({drafter.name})")
