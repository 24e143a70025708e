"""MTP heads: shapes and the file format, the drafter's KV bookkeeping across accept/reject rounds,
training's unrolled view equal to drafting, p_min / n_max cuts, greedy losslessness and the exact
token law under sampling with the `mtp` speculator."""

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
from specjax.drafters.mtp import (MTPDrafter, MTPHead, block_config, head_step, init_heads, load_heads,
                                  make_mtp_drafter, save_heads)
from specjax.engine import speculative_generate
from specjax.models.decoder import forward, logits_from_prenorm
from specjax.models.load import LoadedModel
from specjax.models.kv_cache import KVCache
from specjax.train.loop import TrainConfig, train
from specjax.train.mtp import LossConfig, make_loss_fn, unrolled_outputs
from token_law import COLD_TEMPERATURE, N_GREEDY, STAT_PROMPT, check_token_law, decoder_law, mixed_sampling

K = 4
MAX_NEW = 24
PROMPTS3 = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8]]

B = 8                       # batch of every hand-driven drafter call (one compilation per drafter config)
W = 32                      # padded prompt width / cache capacity of those calls
_jit_unroll = jax.jit(unrolled_outputs, static_argnums=(1, 5))
_jit_init = jax.jit(lambda d, dp, toks, lens, taps, cap: d.init(dp, toks, lens, taps, cap), static_argnums=(0, 5))
_jit_propose = jax.jit(lambda d, dp, st, ctx: d.propose(dp, st, ctx), static_argnums=0)
_jit_commit = jax.jit(lambda d, dp, st, res: d.commit(dp, st, res), static_argnums=0)


@functools.partial(jax.jit, static_argnums=1)
def _prenorm(params, cfg, toks, lens):
  return forward(params, cfg, toks, KVCache.init(cfg, toks.shape[0], toks.shape[1]), n_new=lens)[1]["prenorm"]


def _drafter(cfg, params, heads, k=K, unroll=True):
  return MTPDrafter(cfg=cfg, n_heads=len(heads), max_draft=k, unroll=unroll,
                    weights={"heads": tuple(heads), "target": params})


# drafter configurations of the hand-driven tests: one head with the draft steps unrolled, and two
# heads (steps 0, 1 one head each, then the second recursively) in a while_loop that stops early
CONFIGS = [pytest.param(1, True, id="1head-unrolled"), pytest.param(2, False, id="2heads-while")]


# The tiny head trains with test_train's shapes and settings (4 rows of 24 tokens with float32 taps,
# 2 heads, the same loss): one compilation of the training step serves both files.
TRAIN_SHAPE = (4, 24)
TRAIN_LOSS = LossConfig(n_steps=3, batch_size=4, positions_per_row=8, loss="kl")


@pytest.fixture(scope="module")
def trained_head(tiny_llama, tmp_path_factory):
  """Two heads trained for 100 steps to match the tiny target's distributions (KL) on random token
  rows: right often enough, wrong often enough."""
  cfg, params = tiny_llama

  def batch(step):
    rows = np.random.default_rng(step).integers(0, cfg.vocab_size, TRAIN_SHAPE).astype(np.int32)
    lens = np.full(len(rows), rows.shape[1], np.int32)
    return {"tokens": rows, "lens": lens, "prompt_lens": np.zeros(len(rows), np.int32),
            "prenorm": np.asarray(_prenorm(params, cfg, jnp.asarray(rows), jnp.asarray(lens)))}

  loss_fn = make_loss_fn(cfg, TRAIN_LOSS, 2, jnp.dtype("float32"))
  tc = TrainConfig(steps=100, lr=1e-2, warmup_steps=10, log_every=50, ckpt_every=1000)
  res = train(loss_fn, init_heads(cfg, 2, seed=1), params, batch, tc, tmp_path_factory.mktemp("mtp_tiny"),
              progress=False)
  return res.params


# ----------------------------------------------------------------------------------------------
# the head


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_gemma"])
def test_head_shapes_and_cache(which, request):
  """A head is enorm, hnorm, eh_proj [2D -> D] and one decoder block of the target's family; it maps
  (embedding, hidden) [B, T, D] to a pre-norm hidden state [B, T, D], writes T entries into its
  one-layer cache at slots `lengths..` and commits `n_new`."""
  cfg, params = request.getfixturevalue(which)
  heads = init_heads(cfg, 2, seed=0)
  assert len(heads) == 2
  d = cfg.d_model
  h0 = heads[0]
  assert set(h0) == {"enorm", "hnorm", "eh_proj", "block"}
  assert h0["eh_proj"]["kernel"].shape == (d, 2 * d)
  assert h0["enorm"]["weight"].shape == h0["hnorm"]["weight"].shape == (d,)
  from flax import nnx
  from specjax.models.decoder import Block
  block_state = nnx.to_pure_dict(nnx.split(Block(block_config(cfg), 0, dtype=jnp.float32, rngs=nnx.Rngs(0)))[1])
  assert jax.tree_util.tree_structure(h0["block"]) == jax.tree_util.tree_structure(block_state)
  b, t, cap = 3, 5, 16
  rng = np.random.default_rng(0)
  emb = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
  h = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
  cache = KVCache.init(block_config(cfg), b, cap).with_lengths(jnp.asarray([0, 2, 7]))
  pos = cache.lengths[:, None] + jnp.arange(t)[None, :]
  out, new = jax.jit(head_step, static_argnums=1)(h0, cfg, emb, h, cache, pos, jnp.asarray([5, 3, 0]))
  assert out.shape == (b, t, d)
  assert len(new.k) == 1 and new.k[0].shape == (b, cap, cfg.n_kv_heads, cfg.head_dim)
  assert np.asarray(new.lengths).tolist() == [5, 5, 7]
  written = np.abs(np.asarray(new.k[0])).sum(axis=(2, 3)) > 0                     # [B, S]
  for r, start in enumerate([0, 2, 7]):
    assert written[r].tolist() == [start <= s < start + t for s in range(cap)]
  assert logits_from_prenorm(params, cfg, out).shape == (b, t, cfg.vocab_size)


def test_identity_init_starts_from_the_target(tiny_llama):
  """init="identity" (eh_proj = [0 | I], the block's output projections zero): before training, the
  head's distribution at every base position is the target's own next-token distribution there."""
  cfg, params = tiny_llama
  heads = init_heads(cfg, 1, seed=0, init="identity")
  seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
  toks = jnp.asarray([seq + [0] * (W - len(seq))] * B, jnp.int32)
  pre = _prenorm(params, cfg, toks, jnp.full((B,), len(seq), jnp.int32))
  out0 = _jit_unroll(tuple(heads), cfg, params, toks, pre, K)[0]
  np.testing.assert_allclose(np.asarray(logits_from_prenorm(params, cfg, out0))[0, :len(seq)],
                             np.asarray(logits_from_prenorm(params, cfg, pre))[0, :len(seq)], rtol=1e-4, atol=1e-4)


def test_save_load_roundtrip(tiny_llama, tmp_path):
  """Heads go to bf16 safetensors with HF/DeepSeek-style names ([out, in], q/k/v and gate/up
  unfused) plus a JSON config, come back equal to the bf16-rounded originals, and are refused by a
  target of other sizes."""
  cfg, params = tiny_llama
  heads = init_heads(cfg, 2, seed=3)
  w, c = save_heads(tmp_path / "head.safetensors", heads, cfg, extra={"note": "test"})
  from safetensors.numpy import load_file
  names = set(load_file(str(w)))
  for m in (0, 1):
    assert {f"mtp.{m}.enorm.weight", f"mtp.{m}.hnorm.weight", f"mtp.{m}.eh_proj.weight",
            f"mtp.{m}.self_attn.q_proj.weight", f"mtp.{m}.self_attn.k_proj.weight",
            f"mtp.{m}.mlp.gate_proj.weight", f"mtp.{m}.input_layernorm.weight"} <= names
  assert load_file(str(w))["mtp.0.eh_proj.weight"].shape == (cfg.d_model, 2 * cfg.d_model)
  back, meta = load_heads(w, cfg)
  assert meta["n_heads"] == 2 and meta["note"] == "test"
  for a, b in zip(heads, back):
    ref = jax.tree_util.tree_map(lambda x: np.asarray(x.astype(jnp.bfloat16)), a)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(y), x), ref, b)
  other = cfg.replace(d_model=48)
  with pytest.raises(ValueError, match="another target"):
    load_heads(w, other)
  drafter = make_mtp_drafter(LoadedModel(name="t", cfg=cfg, params=params), str(w))
  assert drafter.n_heads == 2 and drafter.max_draft == 4


# ----------------------------------------------------------------------------------------------
# drafting: the cache across rounds, and training's view of it


def _ctx(seqs, target_len, p_min=0.0, n_max=None):
  b = len(seqs)
  hist = np.zeros((b, 2 * W), np.int32)
  for r, s in enumerate(seqs):
    hist[r, :len(s)] = s
  n_max = np.full(b, K, np.int32) if n_max is None else np.asarray(n_max, np.int32)
  return DraftContext(last=jnp.asarray([s[-1] for s in seqs], jnp.int32), history=jnp.asarray(hist),
                      hist_len=jnp.asarray([len(s) for s in seqs], jnp.int32),
                      target_len=jnp.asarray(target_len, jnp.int32), n_max=jnp.asarray(n_max),
                      p_min=jnp.broadcast_to(jnp.asarray(p_min, jnp.float32), (b,)),
                      temperature=jnp.zeros((b,), jnp.float32))


def _prefill(params, cfg, seqs):
  """Prompt tokens right-padded to [B, W], lengths and the target's taps along them."""
  toks = np.zeros((len(seqs), W), np.int32)
  for r, s in enumerate(seqs):
    toks[r, :len(s)] = s
  lens = jnp.asarray([len(s) for s in seqs], jnp.int32)
  return jnp.asarray(toks), lens, {"prenorm": _prenorm(params, cfg, jnp.asarray(toks), lens)}


def _head_probs(heads, cfg, params, seq, base):
  """Training's view: per step j, the head distribution at base position `base` of token row `seq`."""
  toks = jnp.asarray([list(seq) + [0] * (W - len(seq))] * B, jnp.int32)     # B rows: shapes shared with _prefill
  pre = _prenorm(params, cfg, toks, jnp.full((B,), len(seq), jnp.int32))
  outs = _jit_unroll(tuple(heads), cfg, params, toks, pre, K)
  return [np.asarray(jax.nn.softmax(logits_from_prenorm(params, cfg, o[:, base:base + 1])[0, 0])) for o in outs]


@pytest.mark.parametrize("n_heads,unroll", CONFIGS)
def test_kv_cache_bookkeeping_across_rounds(tiny_llama, n_heads, unroll):
  """Drive init -> (propose -> commit) x 4 by hand for 8 sequences with chosen outcomes (all
  rejected, some accepted, all accepted; one sequence finishes after round 1): after every commit
  each head's cache holds what a fresh `init` over the committed tokens holds (lengths, K/V in the
  committed slots, the pending hidden state), and the next draft equals the fresh state's."""
  cfg, params = tiny_llama
  d = _drafter(cfg, params, init_heads(cfg, n_heads, seed=7), unroll=unroll)
  dp = d.params()
  rng = np.random.default_rng(1)
  seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (6, 2, 9, 3, 5, 7, 4, 8)]   # `last` included
  toks, lens, taps = _prefill(params, cfg, [s[:-1] for s in seqs])
  state = _jit_init(d, dp, toks, lens, taps, W)
  live = np.ones(B, bool)
  for rnd in range(4):
    n_acc = rng.integers(0, K + 1, B)
    n_acc[rnd % B], n_acc[(rnd + 3) % B] = 0, K
    if rnd == 2:
      live[1] = False
    target_len = [len(s) - 1 for s in seqs]
    draft, state = _jit_propose(d, dp, state, _ctx(seqs, target_len))
    dt = np.asarray(draft.tokens)
    verified = np.asarray([[s[-1]] + dt[r].tolist() for r, s in enumerate(seqs)], np.int32)   # [B, K+1]
    _, _, ftaps = _prefill(params, cfg, [s[:-1] + verified[r].tolist() for r, s in enumerate(seqs)])
    pre = np.stack([np.asarray(ftaps["prenorm"])[r, t:t + K + 1] for r, t in enumerate(target_len)])
    nxt = rng.integers(0, cfg.vocab_size, B)
    res = RoundResult(n_accepted=jnp.asarray(n_acc, jnp.int32), next_token=jnp.asarray(nxt, jnp.int32),
                      verified=jnp.asarray(verified), prenorm=jnp.asarray(pre), layer_taps=(),
                      live=jnp.asarray(live))
    state = _jit_commit(d, dp, state, res)
    for r in range(B):
      if live[r]:
        seqs[r] = seqs[r] + dt[r, :n_acc[r]].tolist() + [int(nxt[r])]
    rtoks, rlens, rtaps = _prefill(params, cfg, [s[:-1] for s in seqs])
    ref = _jit_init(d, dp, rtoks, rlens, rtaps, W)
    for r in range(B):
      n = len(seqs[r]) - 2                                           # committed head entries
      for m in range(n_heads):
        got, want = state.caches[m], ref.caches[m]
        assert int(got.lengths[r]) == n, (rnd, r, m)
        for kv_got, kv_want in ((got.k[0], want.k[0]), (got.v[0], want.v[0])):
          np.testing.assert_allclose(np.asarray(kv_got)[r, :n], np.asarray(kv_want)[r, :n], atol=2e-5,
                                     err_msg=f"round {rnd} row {r} head {m}")
      np.testing.assert_allclose(np.asarray(state.pending)[r], np.asarray(ref.pending)[r], atol=2e-5)
    target_len = [len(s) - 1 for s in seqs]
    d_next, _ = _jit_propose(d, dp, state, _ctx(seqs, target_len))
    d_ref, _ = _jit_propose(d, dp, ref, _ctx(seqs, target_len))
    assert np.asarray(d_next.tokens).tolist() == np.asarray(d_ref.tokens).tolist()


@pytest.mark.parametrize("n_heads,unroll", CONFIGS)
def test_training_unroll_drafts_what_the_drafter_drafts(tiny_llama, n_heads, unroll):
  """The training loss's unrolled heads (every base position at once, diagonal attention for the
  draft steps) give, at the base the drafter starts from, the distributions the drafter drafts
  from: the same greedy chain, and top-1 probabilities within 1e-5 (p_min just above step j's
  cuts the draft at j; just below the smallest of steps 0..j lets it reach j + 1). With 2 heads
  and K = 4, steps 0 and 1 use one head each and steps 2, 3 reuse the last one recursively."""
  cfg, params = tiny_llama
  heads = init_heads(cfg, n_heads, seed=5)
  d = _drafter(cfg, params, heads, unroll=unroll)
  prompt, last = [3, 1, 4, 1, 5, 9, 2, 6], 7
  toks, lens, taps = _prefill(params, cfg, [prompt] * B)
  state = _jit_init(d, d.params(), toks, lens, taps, W)
  ctx = _ctx([prompt + [last]] * B, [len(prompt)] * B)
  draft, _ = _jit_propose(d, d.params(), state, ctx)
  chain = np.asarray(draft.tokens)[0].tolist()
  probs = _head_probs(heads, cfg, params, prompt + [last] + chain, len(prompt) - 1)
  assert [int(p.argmax()) for p in probs] == chain
  hi = [float(probs[j].max()) + 1e-5 for j in range(K)]
  lo = [min(float(p.max()) for p in probs[:j + 1]) - 1e-5 for j in range(K)]
  dr, _ = _jit_propose(d, d.params(), state, dataclasses.replace(ctx, p_min=jnp.asarray(hi + lo, jnp.float32)))
  lengths = np.asarray(dr.lengths).tolist()
  assert all(lengths[j] <= j for j in range(K)), lengths
  assert all(lengths[K + j] >= j + 1 for j in range(K)), lengths


def test_p_min_and_n_max_cut_the_draft(tiny_llama, trained_head):
  """Rows with different (n_max, p_min) on the same context: the draft is the head's greedy chain,
  cut after n_max tokens and before the first token whose head probability is below p_min."""
  cfg, params = tiny_llama
  d = _drafter(cfg, params, trained_head, unroll=False)
  prompt, last = [9, 2, 6, 5, 3, 5, 8], 1
  toks, lens, taps = _prefill(params, cfg, [prompt] * B)
  st = _jit_init(d, d.params(), toks, lens, taps, W)
  ctx = _ctx([prompt + [last]] * B, [len(prompt)] * B)
  full, _ = _jit_propose(d, d.params(), st, ctx)
  chain = np.asarray(full.tokens)[0].tolist()
  conf = [float(p.max()) for p in _head_probs(trained_head, cfg, params, prompt + [last] + chain, len(prompt) - 1)]
  cuts = sorted(conf)
  rows = [(K, 0.0), (2, 0.0), (0, 0.0), (K, 1.01)] + [(K, c + 1e-4) for c in cuts[:3]] + [(3, cuts[0] - 1e-4)]
  want = []
  for nm, pm in rows:
    n = 0
    while n < nm and conf[n] >= pm:
      n += 1
    want.append(n)
  assert len(set(want)) >= 4, f"confidences {conf} give too few distinct cut points"
  ctx = dataclasses.replace(ctx, p_min=jnp.asarray([r[1] for r in rows], jnp.float32),
                            n_max=jnp.asarray([r[0] for r in rows], jnp.int32))
  draft, _ = _jit_propose(d, d.params(), st, ctx)
  assert np.asarray(draft.lengths).tolist() == want, (rows, conf)
  for r, n in enumerate(want):
    assert np.asarray(draft.tokens)[r, :n].tolist() == chain[:n]


# ----------------------------------------------------------------------------------------------
# losslessness


N_SEQ = 1000
MIXED_NEW = 12              # tokens per row of the mixed greedy + sampled batch


def test_speculation_with_mtp_is_lossless(tiny_llama, trained_head):
  """One batch, two checks (one compilation): three ragged greedy prompts and 1000 copies of one
  prompt sampled at temperature 1 with top-k 5 / top-p 0.9, each with its own seed.
  - Greedy rows: exactly `generate_plain`'s tokens, with acceptance strictly between 0 and 1.
  - Sampled rows: the joint law of the first three tokens fits the exact law of plain sampling and
    agrees with plain samples (chi-square p >= 1e-4); the statistic rejects temperature 0.7
    (p < 1e-12), so it has power."""
  cfg, params = tiny_llama
  v = cfg.vocab_size
  prompts = PROMPTS3 + [STAT_PROMPT] * N_SEQ
  sampling = mixed_sampling(N_SEQ, first_seed=20_000)
  spec = speculative_generate(params, cfg, prompts, _drafter(cfg, params, trained_head, k=3),
                              max_new_tokens=MIXED_NEW, sampling=sampling)
  plain = generate_plain(params, cfg, prompts, max_new_tokens=MIXED_NEW, sampling=sampling)
  st = spec.stats
  assert spec.tokens[:3] == plain.tokens[:3], "greedy speculative output differs from plain decoding"
  acc3 = sum(st.per_seq_acc_tokens[:3]) / max(sum(st.per_seq_gen_tokens[:3]), 1)
  assert 0.15 <= acc3 <= 0.95, f"greedy acceptance {acc3:.3f}: the head must be sometimes right, sometimes wrong"
  assert sum(st.per_seq_rounds[:3]) < 3 * MIXED_NEW, "speculation saved no target passes"
  acc = sum(st.per_seq_acc_tokens[3:]) / max(sum(st.per_seq_gen_tokens[3:]), 1)
  assert 0.1 <= acc <= 0.95, f"sampled acceptance {acc:.3f}"

  print(f"mixed batch: greedy acceptance {acc3:.3f}, sampled {acc:.3f}")
  colder = generate_plain(params, cfg, prompts, max_new_tokens=MIXED_NEW,
                          sampling=mixed_sampling(N_SEQ, first_seed=20_000, temperature=COLD_TEMPERATURE))
  check_token_law(decoder_law(params, cfg), v, spec.tokens[N_GREEDY:], plain.tokens[N_GREEDY:],
                  colder.tokens[N_GREEDY:])
