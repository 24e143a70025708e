"""The speculative engine with the draft-model drafter: lossless greedy and sampled generation,
per-sequence draft parameters, and refusal of incompatible draft/target pairs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import chi2_gof, jit_forward, perturb, random_params
from specjax.engine.decode import generate_plain
from specjax.drafters.base import DraftContext, DraftParams
from specjax.drafters.draft_model import DraftModelDrafter, IncompatibleDraftError, check_compatible
from specjax.engine import speculative_generate
from specjax.models.decoder import forward
from specjax.engine.sampling import SamplingParams, shaped_probs
from specjax.models.kv_cache import KVCache
from token_law import COLD_TEMPERATURE, P_FAIL, STAT_NEW, STAT_PROMPT, check_token_law, decoder_law, joint_counts

K = 4                       # drafter.max_draft in the greedy tests
MAX_NEW = 24                # same as test_kvcache: shares generate_plain's compilation
TIE_TOL = 1e-4
PROMPTS3 = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8]]
DRAFT_SIGMA = 0.05          # draft = target + 5% noise: acceptance ~0.3-0.6 on these prompts


@pytest.fixture(scope="module")
def noisy_drafter(tiny_llama):
  """A draft model that is sometimes right and sometimes wrong: the target's parameters plus
  Gaussian noise (DRAFT_SIGMA times each tensor's std)."""
  cfg, params = tiny_llama
  return DraftModelDrafter(cfg=cfg, max_draft=K, weights=perturb(params, DRAFT_SIGMA, seed=1))


@pytest.fixture(scope="module")
def plain3(tiny_llama):
  cfg, params = tiny_llama
  return generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW).tokens


def _assert_lossless(params, cfg, prompts, spec, plain, max_ties=1):
  """spec == plain for every sequence, except where the target's top-two logits at the first
  differing step are within TIE_TOL (a float tie between a K+1-token and a 1-token forward);
  at most `max_ties` sequences may differ that way."""
  ties = 0
  for i, (s, p) in enumerate(zip(spec, plain)):
    assert len(s) == len(p), f"sequence {i}: {len(s)} tokens vs {len(p)}"
    if s == p:
      continue
    j = next(t for t, (a, b) in enumerate(zip(s, p)) if a != b)
    ctx = np.asarray([prompts[i] + p[:j]], np.int32)
    logits = np.asarray(jit_forward(params, cfg, jnp.asarray(ctx), KVCache.init(cfg, 1, 128))[0])[0, -1]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] <= TIE_TOL, (
        f"sequence {i} differs from plain decoding at step {j} without a tie "
        f"(top-2 gap {top2[1] - top2[0]:.3g}):\nspec  {s}\nplain {p}")
    ties += 1
  assert ties <= max_ties, f"{ties} float ties: should be rare"


# ----------------------------------------------------------------------------------------------
# greedy losslessness


@pytest.mark.parametrize("which", ["batch1", "batch3_ragged"])
def test_greedy_speculation_is_lossless(tiny_llama, noisy_drafter, plain3, which):
  """Greedy speculative decoding with a draft model that is right 20-90% of the time returns
  exactly `generate_plain`'s tokens, for one prompt and for a ragged batch of three."""
  cfg, params = tiny_llama
  prompts = PROMPTS3[:1] if which == "batch1" else PROMPTS3
  plain = plain3[:len(prompts)]
  res = speculative_generate(params, cfg, prompts, noisy_drafter, max_new_tokens=MAX_NEW)
  acc = res.stats.acceptance_rate
  assert 0.2 <= acc <= 0.9, f"acceptance {acc:.3f} outside [0.2, 0.9]: the drafter must be sometimes right, sometimes wrong"
  assert res.stats.rounds < sum(len(p) for p in plain), "speculation saved no target passes"
  _assert_lossless(params, cfg, prompts, res.tokens, plain)


def test_greedy_lossless_with_perfect_and_useless_drafters(tiny_llama, plain3):
  """Edge drafters: the target itself as draft (acceptance >= 0.95, every round emits more than
  one token on average) and an unrelated random model (acceptance < 0.5) both give exactly the
  plain greedy output."""
  cfg, params = tiny_llama
  perfect = DraftModelDrafter(cfg=cfg, max_draft=K, weights=params)
  res = speculative_generate(params, cfg, PROMPTS3, perfect, max_new_tokens=MAX_NEW)
  assert res.stats.acceptance_rate >= 0.95 and res.stats.tau > 3.0, res.stats.format()
  _assert_lossless(params, cfg, PROMPTS3, res.tokens, plain3)
  useless = DraftModelDrafter(cfg=cfg, max_draft=K, weights=random_params(cfg, seed=99))
  res = speculative_generate(params, cfg, PROMPTS3, useless, max_new_tokens=MAX_NEW)
  assert res.stats.acceptance_rate < 0.5, res.stats.format()
  _assert_lossless(params, cfg, PROMPTS3, res.tokens, plain3)


def test_split_prefill_reports_the_prefill_share_and_changes_no_token(tiny_llama, noisy_drafter, plain3):
  """`split_prefill` (waits for the prefill, for a time split): plain decoding, a device drafter and
  a host drafter report a prefill time inside the call's time, and their tokens are those of the
  unsplit calls; without it nothing is reported."""
  from specjax.drafters.ngram_simple import NgramSimple
  cfg, params = tiny_llama
  plain = generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW, split_prefill=True)
  assert plain.tokens == plain3 and 0 < plain.prefill_seconds < plain.seconds
  assert generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW).prefill_seconds is None
  for drafter in (noisy_drafter, NgramSimple(size_n=1, size_m=K)):
    res = speculative_generate(params, cfg, PROMPTS3, drafter, max_new_tokens=MAX_NEW, split_prefill=True)
    assert res.tokens == speculative_generate(params, cfg, PROMPTS3, drafter, max_new_tokens=MAX_NEW).tokens
    assert 0 < res.prefill_seconds < res.seconds, (drafter.name, res.prefill_seconds, res.seconds)


def test_greedy_lossless_with_stop_token(tiny_llama, noisy_drafter, plain3):
  """With a stop token that occurs mid-draft, speculative output is plain output cut right after
  the stop token's first occurrence (accepted drafts past it are never emitted)."""
  cfg, params = tiny_llama
  stop = plain3[2][7]
  res = speculative_generate(params, cfg, PROMPTS3, noisy_drafter, max_new_tokens=MAX_NEW, stop_ids=(stop,))
  plain = generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW, stop_ids=(stop,)).tokens
  for p_full, p in zip(plain3, plain):
    want = p_full[:p_full.index(stop) + 1] if stop in p_full else p_full
    assert p == want
  _assert_lossless(params, cfg, PROMPTS3, res.tokens, plain)


# ----------------------------------------------------------------------------------------------
# sampled losslessness: the law of the first generated tokens

N_SEQ = 4000


@pytest.fixture(scope="module")
def peaked_target(tiny_llama):
  """The tiny llama with its LM head scaled by 2: lower-entropy next-token laws (so a greedy
  draft is accepted often enough at temperature 1) on the same config (no new compilation)."""
  from flax import nnx
  cfg, params = tiny_llama
  params = jax.tree_util.tree_map(lambda x: x, params)
  pure = nnx.to_pure_dict(params)
  pure["lm_head"]["kernel"] = pure["lm_head"]["kernel"] * 2.0
  nnx.replace_by_pure_dict(params, pure)
  return cfg, params


@pytest.mark.parametrize("shape", [dict(temperature=1.0), dict(temperature=1.0, top_k=5, top_p=0.9)],
                         ids=["temp1", "temp1_topk5_topp0.9"])
def test_sampled_speculation_preserves_the_token_law(peaked_target, shape):
  """4000 sequences with per-sequence seeds, 3 new tokens each, temperature 1 (and with top-k /
  top-p): the joint law of (t1, t2, t3) with speculation fits the exact law of plain sampling
  (chi-square p >= 1e-4), as plain sampling does, and the two samples agree with each other.
  The same statistic rejects plain samples drawn at temperature 0.7 (p < 1e-12), and for the
  truncated case the untruncated law, so the test has power."""
  cfg, params = peaked_target
  v = cfg.vocab_size
  drafter = DraftModelDrafter(cfg=cfg, max_draft=3, weights=perturb(params, DRAFT_SIGMA, seed=2))
  seeds = list(range(10_000, 10_000 + N_SEQ))
  prompts = [STAT_PROMPT] * N_SEQ
  exact = decoder_law(params, cfg, shape)

  sampling = SamplingParams.make(N_SEQ, seed=seeds, **shape)
  spec = speculative_generate(params, cfg, prompts, drafter, max_new_tokens=STAT_NEW, sampling=sampling)
  plain = generate_plain(params, cfg, prompts, max_new_tokens=STAT_NEW, sampling=sampling)
  assert 0.2 <= spec.stats.acceptance_rate <= 0.9, spec.stats.format()
  colder = generate_plain(params, cfg, prompts, max_new_tokens=STAT_NEW, sampling=SamplingParams.make(
      N_SEQ, seed=seeds, **{**shape, "temperature": COLD_TEMPERATURE}))
  check_token_law(exact, v, spec.tokens, plain.tokens, colder.tokens)
  if "top_k" in shape:
    _, _, p_untrunc = chi2_gof(joint_counts(spec.tokens, v), decoder_law(params, cfg, dict(temperature=1.0)))
    assert p_untrunc < P_FAIL, f"the statistic cannot tell the truncated law from the full one (p={p_untrunc:.3g})"


def test_top_k_then_top_p_matches_transformers_warpers():
  """Sampling shape = transformers' Temperature -> TopK -> TopP warpers (llama.cpp applies top-p to
  the candidates left by top-k as well): top-p's cumulative mass is measured on the top-k
  renormalised distribution, not on the full one."""
  import torch
  from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                      TopPLogitsWarper)
  rng = np.random.default_rng(5)
  logits = rng.standard_normal((64, 12)).astype(np.float32) * 2
  cases = [(1.0, 2, 0.5), (0.8, 4, 0.7), (1.3, 6, 0.9), (1.0, 0, 0.6), (0.7, 3, 1.0)]
  for temp, k, top_p in cases:
    ours = np.asarray(shaped_probs(jnp.asarray(logits)[:, None],
                                   SamplingParams.make(64, temperature=temp, top_k=k, top_p=top_p)))[:, 0]
    s = TemperatureLogitsWarper(temp)(None, torch.tensor(logits))
    if k:
      s = TopKLogitsWarper(k)(None, s)
    if top_p < 1:
      s = TopPLogitsWarper(top_p)(None, s)
    ref = torch.softmax(s, -1).numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-5, err_msg=f"temperature={temp} top_k={k} top_p={top_p}")


def test_next_token_is_the_draw_from_the_shaped_distribution():
  """`next_token` gives the tokens `sample(shaped_probs(...))` gives, with the same keys: an all-greedy
  batch (which runs only the argmax, ties to the lowest index), an all-sampled one with top-k / top-p,
  and a mixed one (greedy rows still their argmax)."""
  from specjax.engine.sampling import init_keys, next_token, sample, split_keys
  rng = np.random.default_rng(11)
  logits = jnp.asarray(rng.standard_normal((6, 40)).astype(np.float32) * 3)
  logits = logits.at[0, 7].set(50.0).at[0, 3].set(50.0)                         # a tie: index 3 wins
  for temp, k, p in [(0.0, 0, 1.0), ([0.9] * 6, 5, 0.8), ([0.0, 1.0, 0.0, 0.7, 1.2, 0.0], [0, 3, 0, 0, 8, 0], 0.9)]:
    params = SamplingParams.make(6, temperature=temp, top_k=k, top_p=p, seed=list(range(6)))
    _, use = split_keys(init_keys(params))
    got = np.asarray(jax.jit(next_token)(logits, params, use))
    want = np.asarray(sample(shaped_probs(logits[:, None], params)[:, 0], use))
    np.testing.assert_array_equal(got, want, err_msg=f"temperature={temp} top_k={k} top_p={p}")
    greedy = np.asarray(params.greedy)
    np.testing.assert_array_equal(got[greedy], np.asarray(jnp.argmax(logits, -1))[greedy])
  assert got[0] == 3 or not greedy[0]


# ----------------------------------------------------------------------------------------------
# draft parameters n_max, n_min, p_min per sequence


def test_draft_params_apply_per_sequence(tiny_llama, noisy_drafter, plain3):
  """One batch, three behaviours (DraftParams(n_max=[0, 2, 4], n_min=[0, 0, 3], p_min=[0, 0, p2])):
  sequence 0 never drafts (every round emits one token); sequence 1 verifies exactly 2 draft
  tokens every round; sequence 2 verifies drafts of 3 or 4 tokens only, and some rounds none
  (p_min cut the draft below n_min). Each sequence's output and statistics equal those of the same
  sequence run alone with its parameters, and every output is still the plain greedy output."""
  cfg, params = tiny_llama
  # p_min for sequence 2: the 20th percentile of the draft model's top-1 probability along that
  # sequence's greedy output, so p_min cuts some draft steps but not most, whatever the weights.
  ctx = jnp.asarray([PROMPTS3[2] + plain3[2]], jnp.int32)
  d_logits, _, _ = forward(noisy_drafter.weights, cfg, ctx, KVCache.init(cfg, 1, ctx.shape[1] + 8))
  p2 = float(np.quantile(np.asarray(jax.nn.softmax(d_logits[0], -1).max(-1)), 0.2))
  dp = DraftParams(n_max=[0, 2, 4], n_min=[0, 0, 3], p_min=[0.0, 0.0, p2])
  res = speculative_generate(params, cfg, PROMPTS3, noisy_drafter, max_new_tokens=MAX_NEW, draft_params=dp)
  st = res.stats
  _assert_lossless(params, cfg, PROMPTS3, res.tokens, plain3)

  rounds, gen, acc = st.per_seq_rounds, st.per_seq_gen_tokens, st.per_seq_acc_tokens
  # sequence 0: n_max = 0
  assert gen[0] == 0 and acc[0] == 0 and rounds[0] == MAX_NEW - 1
  # sequence 1: p_min = 0, so every draft is n_max = 2 tokens long
  assert gen[1] == 2 * rounds[1]
  # sequence 2: positions 2 and 3 are only reachable by sequence 2 (n_max 0 and 2 elsewhere);
  # n_min = 3 means every verified draft covers positions 0, 1, 2: gen = 3 * #(dlen>=3) + #(dlen=4)
  by_pos = st.drafted_by_pos
  assert by_pos[2] > 0 and gen[2] == 3 * by_pos[2] + by_pos[3], (gen, by_pos)
  assert rounds[2] > by_pos[2], "p_min never cut a draft below n_min: the test lost its point"

  for i, prompt in enumerate(PROMPTS3):
    alone_dp = DraftParams(n_max=dp.n_max[i], n_min=dp.n_min[i], p_min=dp.p_min[i])
    alone = speculative_generate(params, cfg, [prompt], noisy_drafter, max_new_tokens=MAX_NEW, draft_params=alone_dp)
    assert alone.tokens[0] == res.tokens[i]
    assert (alone.stats.per_seq_rounds[0], alone.stats.per_seq_gen_tokens[0], alone.stats.per_seq_acc_tokens[0]) == \
        (rounds[i], gen[i], acc[i]), f"sequence {i} drafts differently inside the batch"
  # without n_min, the same p_min lets sequence 2 verify drafts shorter than 3: n_min did the cutting
  no_min = speculative_generate(params, cfg, PROMPTS3[2:], noisy_drafter, max_new_tokens=MAX_NEW,
                                draft_params=DraftParams(n_max=4, n_min=0, p_min=p2))
  assert no_min.stats.drafted_by_pos[0] > no_min.stats.drafted_by_pos[2], no_min.stats.drafted_by_pos
  assert no_min.tokens[0] == plain3[2]


@pytest.mark.parametrize("loop", [dict(), dict(block=1), dict(block=2), dict(unroll=False)],
                         ids=["unrolled", "blocks-of-1", "blocks-of-2", "while"])
def test_p_min_and_n_max_cut_the_draft(tiny_llama, noisy_drafter, loop):
  """`DraftModelDrafter.propose` drafts the draft model's greedy chain and stops before the first
  token whose draft probability is below the sequence's p_min, and after n_max tokens: rows with
  different (n_max, p_min) on the same context get exactly those lengths, whichever way the draft
  steps run (all unrolled, early-exit blocks of 1 or 2 unrolled steps, a while_loop)."""
  cfg, _ = tiny_llama
  d = dataclasses.replace(noisy_drafter, **loop)
  dparams = d.params()
  prompt, last = [9, 2, 6, 5, 3, 5, 8], 1
  n = len(prompt)
  # the draft model's greedy chain and its confidences, one token at a time
  chain, conf = [], []
  seq = prompt + [last]
  for _ in range(K):
    logits, _, _ = jit_forward(dparams, cfg, jnp.asarray([seq], jnp.int32), KVCache.init(cfg, 1, 32))
    pr = np.asarray(jax.nn.softmax(logits[0, -1]))
    chain.append(int(pr.argmax()))
    conf.append(float(pr.max()))
    seq = seq + [chain[-1]]
  cuts = sorted(conf)
  rows = [(K, 0.0), (2, 0.0), (0, 0.0), (K, 1.0)] + [(K, c + 1e-4) for c in cuts] + [(3, cuts[0] - 1e-4)]
  b = len(rows)
  n_max = np.asarray([r[0] for r in rows], np.int32)
  p_min = np.asarray([r[1] for r in rows], np.float32)
  want = []
  for nm, pm in rows:
    length = 0
    while length < nm and conf[length] >= pm:
      length += 1
    want.append(length)
  assert len(set(want)) >= 4, f"confidences {conf} give too few distinct cut points"

  tokens = jnp.asarray(np.broadcast_to(prompt, (b, n)), jnp.int32)
  lens = jnp.full((b,), n, jnp.int32)
  cap = 32
  dstate = jax.jit(d.init, static_argnums=4)(dparams, tokens, lens, None, cap)
  history = jnp.zeros((b, cap), jnp.int32).at[:, :n + 1].set(jnp.asarray(prompt + [last]))
  ctx = DraftContext(last=jnp.full((b,), last, jnp.int32), history=history, hist_len=jnp.full((b,), n + 1),
                     target_len=lens, n_max=jnp.asarray(n_max), p_min=jnp.asarray(p_min),
                     temperature=jnp.zeros((b,), jnp.float32))
  draft, _ = jax.jit(d.propose)(dparams, dstate, ctx)
  lengths = np.asarray(draft.lengths).tolist()
  assert lengths == want, f"(n_max, p_min) rows {rows}: lengths {lengths}, want {want} (confidences {conf})"
  for r, length in enumerate(want):
    assert np.asarray(draft.tokens)[r, :length].tolist() == chain[:length]


@pytest.mark.parametrize("block", [1, 2])
def test_early_exit_blocks_draft_what_the_unrolled_drafter_drafts(tiny_llama, noisy_drafter, plain3, block):
  """Draft steps in early-exit blocks (after the first steps, blocks of `block` unrolled steps in a
  while_loop that stops once every sequence stopped drafting) give the fully unrolled drafter's
  rounds exactly: the same tokens, rounds and per-position draft counts, with p_min cutting drafts
  short, and plain decoding's greedy output."""
  cfg, params = tiny_llama
  # p_min: the median of the draft model's top-1 probability along the plain outputs, so drafts
  # stop early often (whole batches too) but not always, whatever the weights
  conf = []
  for prompt, out in zip(PROMPTS3, plain3):
    ctx = jnp.asarray([prompt + out], jnp.int32)
    d_logits, _, _ = forward(noisy_drafter.weights, cfg, ctx, KVCache.init(cfg, 1, ctx.shape[1] + 8))
    conf += np.asarray(jax.nn.softmax(d_logits[0], -1).max(-1)).tolist()
  dp = DraftParams(n_max=K, n_min=0, p_min=float(np.median(conf)))
  ref = speculative_generate(params, cfg, PROMPTS3, dataclasses.replace(noisy_drafter, block=0),
                             max_new_tokens=MAX_NEW, draft_params=dp)
  got = speculative_generate(params, cfg, PROMPTS3, dataclasses.replace(noisy_drafter, block=block),
                             max_new_tokens=MAX_NEW, draft_params=dp)
  assert ref.stats.drafted_by_pos[0] > ref.stats.drafted_by_pos[K - 1], "p_min must cut some drafts short"
  assert got.tokens == ref.tokens
  assert (got.stats.rounds, got.stats.gen_tokens, got.stats.acc_tokens) == (ref.stats.rounds, ref.stats.gen_tokens,
                                                                            ref.stats.acc_tokens)
  assert got.stats.drafted_by_pos == ref.stats.drafted_by_pos
  _assert_lossless(params, cfg, PROMPTS3, got.tokens, plain3)


# ----------------------------------------------------------------------------------------------
# incompatible draft/target pairs


@dataclasses.dataclass
class StandInTokenizer:
  model_type: str = "gpt2"
  add_bos: bool = False
  add_eos: bool = False
  bos_id: int | None = 1
  eos_id: int | None = 2
  vocab_size: int = 1000
  renamed: dict = dataclasses.field(default_factory=dict)

  def token_text(self, i: int) -> str:
    return self.renamed.get(i, f"tok{i}")


@pytest.mark.parametrize("change,fragment", [
    (dict(model_type="llama"), "vocab type"),
    (dict(add_bos=True), "add_bos"),
    (dict(add_eos=True), "add_eos"),
    (dict(bos_id=0), "bos_id"),
    (dict(eos_id=7), "eos_id"),
    (dict(vocab_size=1129), "vocabulary sizes"),
    (dict(renamed={5: "other"}), "token 5"),
    (dict(renamed={999: "other"}), "token 999"),
])
def test_incompatible_draft_raises(change, fragment):
  """Each of llama.cpp's compatibility rules (vocab type, BOS/EOS flags and ids, vocab sizes within
  128, identical text for ids >= 5) refuses the pair with an IncompatibleDraftError naming it."""
  with pytest.raises(IncompatibleDraftError, match=fragment):
    check_compatible(StandInTokenizer(), StandInTokenizer(**change))


@pytest.mark.parametrize("change", [dict(), dict(vocab_size=1128), dict(vocab_size=872), dict(renamed={4: "x"})])
def test_compatible_draft_accepted(change):
  """Identical tokenizers, vocab sizes differing by exactly 128 (same shared texts), or a
  different text below id 5 are accepted."""
  check_compatible(StandInTokenizer(), StandInTokenizer(**change))


@pytest.mark.real
def test_real_tokenizer_compatibility(smollm2_path):
  """The real SmolLM2 tokenizer is compatible with itself and incompatible with a copy whose
  tokens 1000 and 1001 swapped texts, or whose add_bos flag is flipped."""
  from specjax.io.tokenizer import Tokenizer, read_tokenizer_metadata
  meta = read_tokenizer_metadata(smollm2_path)
  target = Tokenizer.from_metadata(meta)
  check_compatible(target, Tokenizer.from_metadata(meta))
  tokens = list(meta["tokenizer.ggml.tokens"])
  tokens[1000], tokens[1001] = tokens[1001], tokens[1000]     # still a valid BPE vocabulary
  with pytest.raises(IncompatibleDraftError, match="token 1000"):
    check_compatible(target, Tokenizer.from_metadata({**meta, "tokenizer.ggml.tokens": tokens}))
  with pytest.raises(IncompatibleDraftError, match="add_bos"):
    check_compatible(target, Tokenizer.from_metadata({**meta, "tokenizer.ggml.add_bos_token": not target.add_bos}))
