"""DFlash: the drafter's shapes and file format, the feature window (ring writes, trim, context shift)
against a reference, the window following accepted tokens across rounds past its bound, training's
batched blocks equal to drafting, the engine's rounds replayed from training's blocks, held-out
evaluation prompts left out of the training rows, p_min / n_max cuts, greedy losslessness (batch 1
and 3) and the exact token law under sampling with the `dflash` speculator."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_LLAMA, ToyTokenizer
from specjax.engine.decode import generate_plain
from specjax.drafters.base import DraftContext, RoundResult
from specjax.drafters.dflash import (DFlashConfig, DFlashDrafter, concat_taps, init_dflash, load_dflash,
                                     make_dflash_drafter, save_dflash, spread_taps)
from specjax.drafters.feature_window import FeatureWindow
from specjax.drafters.registry import make_speculator
from specjax.engine import speculative_generate
from specjax.models.decoder import forward, logits_from_prenorm
from specjax.models.load import LoadedModel
from specjax.models.kv_cache import KVCache
from specjax.train.data import DataConfig, ShardDataset, SourceConfig, build_dataset
from specjax.train.dflash import HeldOut, LossConfig, anchor_blocks, make_loss_fn
from specjax.train.dflash_run import without_held_out
from specjax.train.loop import TrainConfig, train
from token_law import COLD_TEMPERATURE, N_GREEDY, STAT_PROMPT, check_token_law, decoder_law, mixed_sampling

DC = DFlashConfig(taps=(0, 1), n_layers=1, block_size=4, window=8)   # 3 drafts per pass, 8 context positions
K = DC.block_size - 1
B = 8                       # batch of the hand-driven drafter calls (one compilation per drafter config)
W = 32                      # padded prompt width / cache capacity of those calls

_jit_init = jax.jit(lambda d, dp, toks, lens, taps, cap: d.init(dp, toks, lens, taps, cap), static_argnums=(0, 5))
_jit_propose = jax.jit(lambda d, dp, st, ctx: d.propose(dp, st, ctx), static_argnums=0)
_jit_commit = jax.jit(lambda d, dp, st, res: d.commit(dp, st, res), static_argnums=0)
_jit_blocks = jax.jit(anchor_blocks, static_argnums=(2, 3))


@functools.partial(jax.jit, static_argnums=(1, 4))
def _taps(params, cfg, toks, lens, taps):
  _, tapped, _ = forward(params, cfg, toks, KVCache.init(cfg, toks.shape[0], toks.shape[1]), n_new=lens, taps=taps)
  return tapped


def _drafter(cfg, params, dparams, dc=DC, k=K):
  return DFlashDrafter(cfg=cfg, dc=dc, max_draft=k, weights={"dflash": dparams, "target": params})


def _prefill(params, cfg, seqs, taps=DC.taps):
  toks = np.zeros((len(seqs), W), np.int32)
  for r, s in enumerate(seqs):
    toks[r, :len(s)] = s
  lens = jnp.asarray([len(s) for s in seqs], jnp.int32)
  return jnp.asarray(toks), lens, _taps(params, cfg, jnp.asarray(toks), lens, taps)


def _ctx(seqs, target_len, p_min=0.0, n_max=None, temperature=0.0):
  b = len(seqs)
  hist = np.zeros((b, 2 * W), np.int32)
  for r, s in enumerate(seqs):
    hist[r, :len(s)] = s
  n_max = np.full(b, K, np.int32) if n_max is None else np.asarray(n_max, np.int32)
  return DraftContext(last=jnp.asarray([s[-1] for s in seqs], jnp.int32), history=jnp.asarray(hist),
                      hist_len=jnp.asarray([len(s) for s in seqs], jnp.int32),
                      target_len=jnp.asarray(target_len, jnp.int32), n_max=jnp.asarray(n_max),
                      p_min=jnp.broadcast_to(jnp.asarray(p_min, jnp.float32), (b,)),
                      temperature=jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,)))


def _window_map(win: FeatureWindow, r: int) -> dict[int, np.ndarray]:
  pos, feats = np.asarray(win.pos)[r], np.asarray(win.feats)[r]
  return {int(p): feats[s] for s, p in enumerate(pos) if p >= 0}


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory):
  """A drafter trained 150 steps (soft cross-entropy to the tiny target) on rows that are half the
  target's greedy continuations of random 3-token prompts (self-distillation), half random tokens:
  right often enough, wrong often enough."""
  cfg, params = tiny_llama
  rng = np.random.default_rng(0)
  greedy = generate_plain(params, cfg, rng.integers(0, cfg.vocab_size, (16, 3)).tolist(), max_new_tokens=21).tokens
  pool = np.concatenate([rng.integers(0, cfg.vocab_size, (16, 3)), np.asarray(greedy)], axis=1).astype(np.int32)

  def batch(step):
    r = np.random.default_rng(step)
    rows = np.concatenate([pool[r.integers(0, len(pool), 2)], r.integers(0, cfg.vocab_size, (2, 24))]).astype(np.int32)
    return {"tokens": rows, "lens": np.full(4, 24, np.int32), "prompt_lens": np.full(4, 3, np.int32)}

  loss_fn = make_loss_fn(cfg, DC, LossConfig(anchors_per_row=6, batch_size=4, loss="kl"), jnp.dtype("float32"))
  tc = TrainConfig(steps=150, lr=1e-2, warmup_steps=10, log_every=50, ckpt_every=1000)
  res = train(loss_fn, init_dflash(cfg, DC, seed=1, target_params=params), params, batch, tc,
              tmp_path_factory.mktemp("dflash_tiny"), progress=False)
  assert res.metrics["loss"] < 2.8 and res.metrics["acc_01"] > 0.4, res.metrics
  return res.params


# ----------------------------------------------------------------------------------------------
# the drafter and its file


def test_config_shapes_and_file_format(tiny_llama, tmp_path):
  """Taps spread from layer 1 to N-3 (SmolLM2's 30 layers: 1, 8, 14, 20, 27); fc [n_taps * D -> D],
  a MASK embedding and n_layers decoder blocks; bf16 safetensors with HF-style names come back
  equal to the bf16-rounded originals, a target of other sizes is refused, and `dflash` loads
  through the registry with n_max drafts per pass."""
  assert spread_taps(30, 5) == (1, 8, 14, 20, 27)
  assert spread_taps(30, 3) == (1, 14, 27) and spread_taps(2, 2) == (1,)
  cfg, params = tiny_llama
  dc = DFlashConfig(taps=(0, 1), n_layers=2, block_size=5, window=6)
  dp = init_dflash(cfg, dc, seed=3, target_params=params)
  d = cfg.d_model
  assert dp["fc"]["kernel"].shape == (d, 2 * d) and dp["mask_embedding"].shape == (d,)
  assert set(dp["layers"]) == {0, 1}
  w, c = save_dflash(tmp_path / "dflash.safetensors", dp, cfg, dc, extra={"note": "test"})
  from safetensors.numpy import load_file
  names = set(load_file(str(w)))
  assert {"fc.weight", "hidden_norm.weight", "mask_embedding", "layers.1.self_attn.q_proj.weight",
          "layers.0.self_attn.v_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.1.input_layernorm.weight"} <= names
  assert load_file(str(w))["fc.weight"].shape == (d, 2 * d)
  back, dc_back, meta = load_dflash(w, cfg)
  assert dc_back == dc and meta["note"] == "test"
  ref = jax.tree_util.tree_map(lambda x: np.asarray(x.astype(jnp.bfloat16)), dp)
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(y), x), ref, back)
  with pytest.raises(ValueError, match="another target"):
    load_dflash(w, cfg.replace(d_model=48))
  from specjax.drafters.base import DraftParams
  drafter = make_speculator("dflash", LoadedModel(name="t", cfg=cfg, params=params), head=str(w),
                            draft_params=DraftParams(n_max=3))
  assert isinstance(drafter, DFlashDrafter) and drafter.max_draft == 3 and drafter.taps == (0, 1)
  with pytest.raises(ValueError, match="exceeds"):
    make_dflash_drafter(LoadedModel(name="t", cfg=cfg, params=params), str(w), DraftParams(n_max=5))


def test_large_drafter_files_are_written_in_shards(tiny_llama, tmp_path):
  """A drafter past the file-size cap is written as `X.safetensors` + `X-2.safetensors`, ... (each
  under the cap unless one tensor is larger; the first file names the others): loading the first
  gives every tensor back, load_dflash gives the same drafter as the one-file save, a smaller
  re-save leaves no stale shard, and a missing shard is an error."""
  from safetensors import safe_open
  from safetensors.numpy import load_file

  from specjax.drafters.head_file import load_tensors, save_tensors
  cfg, params = tiny_llama
  dc = DFlashConfig(taps=(0, 1), n_layers=2, block_size=5, window=6)
  dp = init_dflash(cfg, dc, seed=4, target_params=params)
  one, _ = save_dflash(tmp_path / "one" / "dflash.safetensors", dp, cfg, dc)
  flat = load_file(str(one))
  cap = sum(a.nbytes for a in flat.values()) // 3
  files = save_tensors(flat, tmp_path / "dflash.safetensors", {"format": "x"}, max_bytes=cap)
  assert len(files) >= 3 and files[1].name == "dflash-2.safetensors"
  biggest = max(a.nbytes for a in flat.values())
  assert all(f.stat().st_size <= max(cap, biggest) + 16_384 for f in files)
  with safe_open(str(files[0]), framework="numpy") as f:
    assert f.metadata()["shards"] == ",".join(p.name for p in files[1:]) and f.metadata()["format"] == "x"
  back = load_tensors(files[0])
  assert set(back) == set(flat)
  for k, v in flat.items():
    np.testing.assert_array_equal(back[k], v)
  (tmp_path / "dflash.json").write_text((one.parent / "dflash.json").read_text())
  sharded, dc_back, _ = load_dflash(files[0], cfg)
  single, _, _ = load_dflash(one, cfg)
  assert dc_back == dc
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), single, sharded)
  again = save_tensors(flat, tmp_path / "dflash.safetensors", {"format": "x"}, max_bytes=2 * cap)
  assert sorted(p.name for p in tmp_path.glob("dflash*.safetensors")) == sorted(p.name for p in again)
  again[-1].unlink()
  with pytest.raises(FileNotFoundError, match="not beside it"):
    load_tensors(again[0])

def test_feature_window_against_reference():
  """Random appends (sometimes more rows than the window), trims and context shifts on a window of
  5 positions: after every edit each sequence's window maps exactly the positions in
  [length - 5, length) it was given (shifted as llama.cpp's context shift moves them) to their rows."""
  rng = np.random.default_rng(0)
  b, size, dim = 3, 5, 2
  win = FeatureWindow.empty(b, size, dim)
  ref = [dict() for _ in range(b)]
  length = np.zeros(b, np.int64)
  app = jax.jit(lambda w, rows, pos, n: w.append(rows, pos, n))
  for step in range(40):
    op = rng.choice(["append", "append", "append", "trim", "shift"])
    if op == "append":
      t = 7
      count = rng.integers(0, t + 1, b)
      pos = length[:, None] + np.arange(t)[None, :]
      rows = rng.standard_normal((b, t, dim)).astype(np.float32)
      win = app(win, jnp.asarray(rows), jnp.asarray(pos, jnp.int32), jnp.asarray(count, jnp.int32))
      for r in range(b):
        ref[r].update({int(pos[r, j]): rows[r, j] for j in range(count[r])})
      length = length + count
    elif op == "trim":
      new = np.maximum(length - rng.integers(0, 4, b), 0)
      win = win.trim(jnp.asarray(new, jnp.int32))
      ref = [{p: v for p, v in m.items() if p < new[r]} for r, m in enumerate(ref)]
      length = new
    else:
      keep = rng.integers(0, np.maximum(length, 1))
      discard = np.minimum(rng.integers(1, 4, b), length - keep)
      win = win.shift(jnp.asarray(keep, jnp.int32), jnp.asarray(discard, jnp.int32))
      ref = [{(p - discard[r] if p >= keep[r] + discard[r] else p): v for p, v in m.items()
              if not keep[r] <= p < keep[r] + discard[r]} for r, m in enumerate(ref)]
      length = length - discard
    ref = [{p: v for p, v in m.items() if p >= length[r] - size} for r, m in enumerate(ref)]
    for r in range(b):
      got = _window_map(win, r)
      assert sorted(got) == sorted(ref[r]), (step, op, r, sorted(got), sorted(ref[r]))
      for p in got:
        np.testing.assert_array_equal(got[p], ref[r][p])
      assert all(int(s) == p % size for s, p in enumerate(np.asarray(win.pos)[r]) if p >= 0)


def test_window_follows_accepted_tokens(tiny_llama, trained):
  """Drive init -> (propose -> commit) x 6 by hand for 8 sequences with chosen outcomes (all
  rejected, some accepted, all accepted; one sequence finishes after round 2), until every context
  is longer than the 8-position window: after every commit each window holds exactly the fused
  target features of the last 8 committed positions (what a fresh `init` over the committed tokens
  holds), and the next draft (tokens and q) equals the fresh state's."""
  cfg, params = tiny_llama
  d = _drafter(cfg, params, trained)
  dp = d.params()
  rng = np.random.default_rng(1)
  seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (6, 2, 9, 3, 5, 7, 4, 8)]   # `last` included
  toks, lens, taps = _prefill(params, cfg, [s[:-1] for s in seqs])
  state = _jit_init(d, dp, toks, lens, taps, W)
  live = np.ones(B, bool)
  for rnd in range(6):
    n_acc = rng.integers(0, K + 1, B)
    n_acc[rnd % B], n_acc[(rnd + 3) % B] = 0, K
    if rnd == 2:
      live[1] = False
    target_len = [len(s) - 1 for s in seqs]
    draft, state = _jit_propose(d, dp, state, _ctx(seqs, target_len))
    dt = np.asarray(draft.tokens)
    verified = np.asarray([[s[-1]] + dt[r].tolist() for r, s in enumerate(seqs)], np.int32)   # [B, K+1]
    _, _, ftaps = _prefill(params, cfg, [s[:-1] + verified[r].tolist() for r, s in enumerate(seqs)])
    layer_taps = tuple(np.stack([np.asarray(x)[r, t:t + K + 1] for r, t in enumerate(target_len)])
                       for x in ftaps["layers"])
    nxt = rng.integers(0, cfg.vocab_size, B)
    res = RoundResult(n_accepted=jnp.asarray(n_acc, jnp.int32), next_token=jnp.asarray(nxt, jnp.int32),
                      verified=jnp.asarray(verified), prenorm=jnp.zeros((B, K + 1, cfg.d_model)),
                      layer_taps=tuple(jnp.asarray(x) for x in layer_taps), live=jnp.asarray(live))
    state = _jit_commit(d, dp, state, res)
    for r in range(B):
      if live[r]:
        seqs[r] = seqs[r] + dt[r, :n_acc[r]].tolist() + [int(nxt[r])]
    rtoks, rlens, rtaps = _prefill(params, cfg, [s[:-1] for s in seqs])
    ref = _jit_init(d, dp, rtoks, rlens, rtaps, W)
    for r in range(B):
      got, want = _window_map(state.window, r), _window_map(ref.window, r)
      n = len(seqs[r]) - 1                                                         # committed positions
      assert sorted(got) == sorted(want) == list(range(max(n - DC.window, 0), n)), (rnd, r, sorted(got))
      for p in got:
        np.testing.assert_allclose(got[p], want[p], atol=2e-5, err_msg=f"round {rnd} row {r} position {p}")
    target_len = [len(s) - 1 for s in seqs]
    d_next, _ = _jit_propose(d, dp, state, _ctx(seqs, target_len))
    d_ref, _ = _jit_propose(d, dp, dataclasses.replace(ref, keys=state.keys), _ctx(seqs, target_len))
    assert np.asarray(d_next.tokens).tolist() == np.asarray(d_ref.tokens).tolist()
    np.testing.assert_allclose(np.asarray(d_next.q), np.asarray(d_ref.q), atol=1e-5)
  assert min(len(s) for r, s in enumerate(seqs) if live[r]) - 1 > DC.window, [len(s) for s in seqs]


def test_training_blocks_draft_what_the_drafter_drafts(tiny_llama, trained):
  """Training's batched blocks (several anchors of a row in one pass, block-diagonal mask, context
  [a - window, a)) give at each anchor the logits the drafter drafts from with `last` = x_a at
  position a, before and past the window's bound; and the draft is cut after n_max tokens and
  before the first whose probability is below p_min."""
  cfg, params = tiny_llama
  d = _drafter(cfg, params, trained)
  dp = d.params()
  row = np.random.default_rng(3).integers(0, cfg.vocab_size, 24).tolist()
  anchors = [3, 6, 8, 12, 15, 20, 1, 9]                                             # 8 anchors = B drafter rows
  toks = jnp.asarray([row], jnp.int32)
  taps = _taps(params, cfg, toks, jnp.asarray([24], jnp.int32), DC.taps)
  from specjax.drafters.dflash import concat_taps, model_of
  h = _jit_blocks(trained, params, cfg, DC, toks, concat_taps(taps["layers"]), jnp.asarray([anchors], jnp.int32))
  from specjax.models.decoder import logits_from_prenorm
  train_logits = np.asarray(logits_from_prenorm(params, cfg, h[0, :, 1:]))          # [A, K, V]
  seqs = [row[:a + 1] for a in anchors]
  ptoks, plens, ptaps = _prefill(params, cfg, [s[:-1] for s in seqs])
  st = _jit_init(d, dp, ptoks, plens, ptaps, W)
  logits = np.asarray(jax.jit(d.logits)(dp, st, jnp.asarray([s[-1] for s in seqs]), jnp.asarray(anchors)))
  np.testing.assert_allclose(logits, train_logits, atol=1e-4)
  # p_min / n_max cuts, greedy: the draft is the argmax chain, cut at n_max and below p_min
  probs = jax.nn.softmax(logits, axis=-1).max(axis=-1)                              # [B, K]
  n_max = np.asarray([3, 2, 0, 3, 3, 1, 3, 3])
  p_min = np.asarray([0.0, 0.0, 0.0, 1.01, probs[4, 1] + 1e-4, 0.0, probs[6, 2] + 1e-4, probs[7].min() - 1e-4])
  draft, _ = _jit_propose(d, dp, st, _ctx(seqs, anchors, p_min=p_min, n_max=n_max))
  want = [min(int(np.cumprod(probs[r] >= p_min[r]).sum()), n_max[r]) for r in range(B)]
  assert np.asarray(draft.lengths).tolist() == want
  assert np.asarray(draft.tokens).tolist() == logits.argmax(-1).tolist()
  assert len(set(want)) >= 4, want
  np.testing.assert_array_equal(np.asarray(draft.q).max(-1), 1.0)                   # greedy q: one-hot


def test_engine_rounds_replay_from_training_blocks(tiny_llama, trained):
  """The engine's acceptance is what the training forward predicts: greedy `speculative_generate`
  over three ragged prompts (32 new tokens, contexts past the 8-position window, rounds with partial
  acceptance) runs, per sequence, exactly the rounds replayed from training's teacher-forced blocks
  (`anchor_blocks` at every position of plain decoding's output: a round at anchor a accepts the
  longest prefix of block slots whose argmax is the next plain token, then moves to a + n + 1), and
  accepts exactly as many drafts at every draft position."""
  cfg, params = tiny_llama
  d = _drafter(cfg, params, trained)
  spec = speculative_generate(params, cfg, PROMPTS3, d, max_new_tokens=MAX_NEW)
  longer = generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW + K + 1).tokens   # every block's labels
  rounds, accepted = [], np.zeros(K, np.int64)
  for p, gen in zip(PROMPTS3, longer):
    row = np.asarray(p + gen, np.int32)
    toks = jnp.asarray(np.pad(row, (0, 2 * W - len(row)))[None])                    # one width: one compilation
    taps = _taps(params, cfg, toks, jnp.asarray([len(row)], jnp.int32), DC.taps)
    anchors = np.arange(len(p), len(p) + MAX_NEW)                                   # every position `last` can take
    h = _jit_blocks(trained, params, cfg, DC, toks, concat_taps(taps["layers"]), jnp.asarray(anchors[None]))
    pred = np.asarray(jnp.argmax(logits_from_prenorm(params, cfg, h[0, :, 1:]), -1))   # [A, K]
    hit = pred == row[anchors[:, None] + np.arange(1, K + 1)[None, :]]
    n_rounds, emitted, a = 0, 1, len(p)                                              # the prefill emitted one token
    while emitted < MAX_NEW:
      n = int(np.cumprod(hit[a - len(p)]).sum())
      accepted[:n] += 1
      emitted, a, n_rounds = emitted + n + 1, a + n + 1, n_rounds + 1
    rounds.append(n_rounds)
  st = spec.stats
  assert spec.tokens == [g[:MAX_NEW] for g in longer]
  assert list(st.per_seq_rounds) == rounds, (st.per_seq_rounds, rounds)
  assert list(st.accepted_by_pos) == accepted.tolist(), (st.accepted_by_pos, accepted)
  assert 0 < accepted[0] < sum(rounds), "need both accepted and rejected first drafts"


def test_held_out_prompts_leave_the_training_rows(tiny_llama, tmp_path):
  """A dataset built from 12 prompts (greedy answers and reference answers) with the first 5 of the
  prompt file held out: exactly the rows of those prompts (known from the builder's shuffled order)
  are dropped, and a whole epoch of training batches holds every other row once and no held-out row."""
  cfg, params = tiny_llama
  target = LoadedModel(name="tiny", cfg=cfg, params=params, tokenizer=ToyTokenizer(), source="tiny-llama")
  texts = ["abcdefghijkl"[:n] for n in range(1, 13)]                               # distinct token prompts
  prompts = tmp_path / "toy_questions.jsonl"
  prompts.write_text("".join(json.dumps({"question_id": i, "category": "toy", "turns": [t], "reference": [t[::-1]]})
                             + "\n" for i, t in enumerate(texts)))
  base = dict(sources=(SourceConfig(str(prompts)),), n_sequences=8, max_prompt_len=14, max_new_tokens=6,
              batch_size=4, temperature=0.0, store_taps=False, seed=0)
  dirs = [tmp_path / "greedy", tmp_path / "ref"]
  build_dataset(target, DataConfig(dir=str(dirs[0]), **base), progress=False)
  build_dataset(target, DataConfig(dir=str(dirs[1]), responses="reference", **{**base, "seed": 3}), progress=False)
  full = ShardDataset(dirs)
  ds, n_dropped = without_held_out(full, target, [HeldOut(str(prompts), 5)])
  in_data = [np.random.default_rng(seed).permutation(12)[:8] for seed in (0, 3)]  # the builder's prompt order
  want_dropped = sum(int(np.sum(order < 5)) for order in in_data)
  assert 0 < n_dropped == want_dropped == len(full) - len(ds), (n_dropped, want_dropped)
  held = {tuple(ToyTokenizer().encode_chat([{"content": t}])) for t in texts[:5]}
  row_key = lambda toks, plen: tuple(toks[:plen].tolist())
  epoch = [ds.batch(s, 3, seed=1, with_taps=False) for s in range(-(-len(ds) // 3))]
  seen = [row_key(t, pl) for b in epoch for t, pl in zip(b["tokens"], b["prompt_lens"])][:len(ds)]
  kept = [row_key(full.arrays["tokens"][r], full.arrays["prompt_lens"][r]) for r in range(len(full))]
  kept = [k for k in kept if k not in held]
  assert sorted(seen) == sorted(kept) and not held & set(seen)
  assert ds.n_response_tokens == sum(int(full.arrays["lens"][r] - full.arrays["prompt_lens"][r]) for r in range(len(full))
                                     if row_key(full.arrays["tokens"][r], full.arrays["prompt_lens"][r]) not in held)


# ----------------------------------------------------------------------------------------------
# losslessness


N_SEQ = 1000
MAX_NEW = 32                # > the 8-position window: drafting runs past its bound
MIXED_NEW = 12
PROMPTS3 = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8]]


def test_greedy_is_lossless_batch_1_and_3(tiny_llama, trained):
  """Greedy speculation with `dflash` gives exactly plain decoding's tokens for one prompt alone and
  for three ragged prompts together, over 32 new tokens (contexts well past the 8-position window),
  with drafts both accepted (at least 3 tokens) and rejected, and fewer target passes than tokens."""
  cfg, params = tiny_llama
  d = _drafter(cfg, params, trained)
  for prompts in ([PROMPTS3[1]], PROMPTS3):
    spec = speculative_generate(params, cfg, prompts, d, max_new_tokens=MAX_NEW)
    plain = generate_plain(params, cfg, prompts, max_new_tokens=MAX_NEW)
    assert spec.tokens == plain.tokens, f"batch {len(prompts)}: greedy speculative output differs from plain"
    st = spec.stats
    n_acc, n_gen = sum(st.per_seq_acc_tokens), sum(st.per_seq_gen_tokens)
    print(f"batch {len(prompts)}: {n_acc} of {n_gen} drafted tokens accepted in {sum(st.per_seq_rounds)} rounds")
    assert 3 <= n_acc <= 0.95 * n_gen, f"batch {len(prompts)}: {n_acc} of {n_gen} drafts accepted"
    assert sum(st.per_seq_rounds) < len(prompts) * MAX_NEW


def test_sampling_keeps_the_token_law(tiny_llama, trained):
  """One batch of three ragged greedy prompts and 1000 copies of one prompt sampled at temperature 1
  with top-k 5 / top-p 0.9, each with its own seed, drafts drawn from q:
  - greedy rows: exactly `generate_plain`'s tokens;
  - sampled rows: the joint law of the first three tokens fits the exact law of plain sampling and
    agrees with plain samples (chi-square p >= 1e-4); the statistic rejects temperature 0.7."""
  cfg, params = tiny_llama
  v = cfg.vocab_size
  prompts = PROMPTS3 + [STAT_PROMPT] * N_SEQ
  sampling = mixed_sampling(N_SEQ, first_seed=30_000)
  spec = speculative_generate(params, cfg, prompts, _drafter(cfg, params, trained), max_new_tokens=MIXED_NEW,
                              sampling=sampling)
  plain = generate_plain(params, cfg, prompts, max_new_tokens=MIXED_NEW, sampling=sampling)
  assert spec.tokens[:3] == plain.tokens[:3], "greedy speculative output differs from plain decoding"
  st = spec.stats
  acc = sum(st.per_seq_acc_tokens[3:]) / max(sum(st.per_seq_gen_tokens[3:]), 1)
  assert 0.1 <= acc <= 0.95, f"sampled acceptance {acc:.3f}"
  print(f"dflash mixed batch: sampled acceptance {acc:.3f}")
  colder = generate_plain(params, cfg, prompts, max_new_tokens=MIXED_NEW,
                          sampling=mixed_sampling(N_SEQ, first_seed=30_000, temperature=COLD_TEMPERATURE))
  check_token_law(decoder_law(params, cfg), v, spec.tokens[N_GREEDY:], plain.tokens[N_GREEDY:],
                  colder.tokens[N_GREEDY:], what="speculative sampling (dflash)")
