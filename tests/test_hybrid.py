"""The hybrid family (Qwen3.5: gated DeltaNet + gated attention): parity with transformers, the
chunked form equals the recurrent form, both rollback modes restore the state of plain decoding,
and speculation on the hybrid target is lossless (greedy: model drafter and ngram_simple, batches
of 1 and 3, both modes; sampling: the token law of plain sampling).

One tiny transformers-built checkpoint (V=16, layers linear / full / linear) serves every test, so
the jitted programs (shapes) are shared: compilation dominates this file's time on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import randomize_hf_
from specjax.drafters.ngram_device import NgramSimpleDevice
from specjax.engine.decode import generate_plain
from specjax.drafters.hybrid_draft_model import HybridDraftModelDrafter
from specjax.engine import speculative_generate
from specjax.models.gated_deltanet import gated_delta_chunked, gated_delta_recurrent
from specjax.models.hybrid import hybrid_forward, rollback_redecode
from specjax.models.hybrid_weights import load_hybrid
from specjax.models.recurrent_state import HybridState, rollback_per_step
from specjax.engine.sampling import SamplingParams
from token_law import COLD_TEMPERATURE, STAT_NEW, STAT_PROMPT, check_token_law, exact_joint_law

V = 16
MAX_NEW = 32                # the greedy parity length; also the losslessness runs (shared compilation)
K = 4                       # draft length
PROMPTS3 = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8]]
DRAFT_SIGMA = 0.05
TOL = dict(rtol=2e-4, atol=2e-4)


def _hf_config():
  from transformers import Qwen3_5TextConfig
  return Qwen3_5TextConfig(
      vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8,
      linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6,
      layer_types=["linear_attention", "full_attention", "linear_attention"], tie_word_embeddings=False,
      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
  """(transformers Qwen3_5ForCausalLM, specjax cfg, params, checkpoint dir): random weights, saved
  as safetensors and loaded by specjax. Decays exp(g) mostly in 0.7..0.97: the state remembers."""
  import torch
  from transformers import AutoModelForCausalLM
  torch.manual_seed(0)
  model = AutoModelForCausalLM.from_config(_hf_config()).float().eval()
  randomize_hf_(model, seed=7)
  gen = torch.Generator().manual_seed(8)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("A_log"):
        p.copy_(torch.empty(p.shape).uniform_(0.05, 0.5, generator=gen).log())
      elif name.endswith("dt_bias"):
        p.copy_(0.5 * torch.randn(p.shape, generator=gen))
  path = tmp_path_factory.mktemp("hf_qwen3_5")
  model.save_pretrained(str(path), safe_serialization=True)
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  loaded = load_hybrid(path)
  # Chunks of 16 (a compute setting, not a weight): prefill of the 64-wide padded prompts runs
  # the multi-chunk scan, and batched prefill of 4000 sequences stays cheap on CPU.
  return model, loaded.cfg.replace(chunk_size=16), loaded.params, path


def perturb(params, sigma: float, seed: int):
  """conftest's `perturb` (params + sigma * max(std, 0.1) * N(0, 1), leaf by leaf) drawn with numpy."""
  rng = np.random.default_rng(seed)
  def noisy(x):
    x = np.asarray(x)
    return jnp.asarray(x + sigma * max(float(np.std(x)), 0.1) * rng.standard_normal(x.shape), x.dtype)
  return jax.tree_util.tree_map(noisy, params)


@pytest.fixture(scope="module")
def pair(hf_ckpt):
  """(transformers model, specjax cfg, params)."""
  return hf_ckpt[:3]


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "per_step"))
def fwd(params, tokens, state, n_new=None, *, cfg, mode="auto", per_step=False):
  return hybrid_forward(params, cfg, tokens, state, n_new=n_new, mode=mode, return_per_step=per_step)


@pytest.fixture(scope="module")
def plain3(pair):
  _, cfg, params = pair
  return generate_plain(params, cfg, PROMPTS3, max_new_tokens=MAX_NEW).tokens


# ----------------------------------------------------------------------------------------------
# parity with transformers


def test_config_and_weights_load(hf_ckpt):
  """config.json -> HybridConfig (layer pattern, partial rotary, DeltaNet heads), also from the
  multimodal "qwen3_5" wrapper; the loader ignores the MTP head and vision tower and refuses
  tensors it has no place for."""
  from specjax.io.safetensors import load_safetensors_dir
  from specjax.models.hybrid_config import hybrid_config_from_hf, is_hybrid_hf_config
  from specjax.models.hybrid_weights import params_from_hf
  _, cfg, params, path = hf_ckpt
  assert cfg.layer_types == ("linear", "full", "linear") and cfg.rotary_dim == 4
  assert (cfg.lin_k_heads, cfg.lin_v_heads, cfg.conv_dim) == (2, 4, 2 * 16 + 32)
  assert not cfg.tie_embeddings and params["lm_head"]["kernel"].shape == (V, 32)
  hf, tensors = load_safetensors_dir(path)
  wrapped = {"model_type": "qwen3_5", "text_config": {**hf, "model_type": "qwen3_5_text"}, "tie_word_embeddings": False}
  assert is_hybrid_hf_config(hf) and is_hybrid_hf_config(wrapped)
  assert hybrid_config_from_hf(wrapped).replace(chunk_size=16) == cfg
  params_from_hf(cfg, {**tensors, "mtp.fc.weight": np.zeros(1), "model.visual.x.weight": np.zeros(1)})
  with pytest.raises(ValueError, match="no place for"):
    params_from_hf(cfg, {**tensors, "model.layers.0.linear_attn.extra.weight": np.zeros(1)})
  with pytest.raises(KeyError, match="in_proj_z"):
    params_from_hf(cfg, {n: t for n, t in tensors.items() if "layers.2.linear_attn.in_proj_z" not in n})


def test_prefill_and_decode_logits_match_transformers(pair):
  """Logits of a 20-token prompt in one chunked pass, and token by token through the recurrent
  form with the conv / recurrent state carried, equal transformers' (full pass and its own cached
  token-by-token decode) to float32 tolerance."""
  import torch
  hf, cfg, params = pair
  prompt = np.random.default_rng(0).integers(0, V, (1, 20))
  with torch.no_grad():
    ref = hf(torch.tensor(prompt)).logits[0].numpy()
    cache, ref_steps = None, []
    for t in range(prompt.shape[1]):
      out = hf(input_ids=torch.tensor(prompt[:, t:t + 1]), cache=cache, use_cache=True)
      cache = out.cache
      ref_steps.append(out.logits[0, 0].numpy())
  np.testing.assert_allclose(np.stack(ref_steps), ref, **TOL)    # transformers' own two forms agree

  state0 = HybridState.init(cfg, 1, 32)
  logits, _, _ = fwd(params, jnp.asarray(prompt, jnp.int32), state0, cfg=cfg)
  np.testing.assert_allclose(np.asarray(logits[0]), ref, **TOL)
  state, steps = state0, []
  for t in range(prompt.shape[1]):
    logits, _, state = fwd(params, jnp.asarray(prompt[:, t:t + 1], jnp.int32), state, cfg=cfg)
    steps.append(np.asarray(logits[0, 0]))
  np.testing.assert_allclose(np.stack(steps), np.stack(ref_steps), **TOL)


def test_greedy_continuations_match_transformers(pair, plain3):
  """32-token greedy continuations (chunked prefill, then recurrent decode; ragged batch of 3)
  equal transformers' `generate` token for token."""
  import torch
  hf, _, _ = pair
  for prompt, ours in zip(PROMPTS3, plain3):
    with torch.no_grad():
      ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(prompt):].tolist()
    assert ours == ref


# ----------------------------------------------------------------------------------------------
# chunked == recurrent; both rollbacks == plain decoding

T_BLOCK = K + 1


def test_gated_delta_chunked_equals_recurrent():
  """The parallel form (several chunks, a ragged last one, from a non-zero state) gives the
  recurrent form's outputs, final state and every per-step state."""
  rng = np.random.default_rng(1)
  b, t, h, dk, dv = 2, 11, 3, 4, 5
  q, k = (jnp.asarray(rng.standard_normal((b, t, h, dk)), jnp.float32) for _ in range(2))
  q, k = q / jnp.linalg.norm(q, axis=-1, keepdims=True), k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jnp.asarray(rng.standard_normal((b, t, h, dv)), jnp.float32)
  g = jnp.asarray(-rng.uniform(0.01, 2.0, (b, t, h)), jnp.float32)
  beta = jnp.asarray(rng.uniform(0, 1, (b, t, h)), jnp.float32)
  s0 = jnp.asarray(rng.standard_normal((b, h, dk, dv)), jnp.float32)
  o_r, s_r, st_r = jax.jit(functools.partial(gated_delta_recurrent, per_step=True))(q, k, v, g, beta, s0)
  for chunk in (4, 64):    # three chunks, the last one ragged; one chunk as wide as the block
    o_c, s_c, st_c = jax.jit(functools.partial(gated_delta_chunked, chunk=chunk, per_step=True))(q, k, v, g, beta, s0)
    np.testing.assert_allclose(o_c, o_r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s_c, s_r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(st_c, st_r, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(st_r[:, -1], s_r)


@pytest.fixture(scope="module")
def block_case(pair):
  """A ragged batch of 4 in the middle of generation (state after a 5-token prefix), a block of
  T_BLOCK new tokens with n_new = (5, 1, 3, 0), and the tokens fed one at a time by the recurrent
  form instead: [(logits [B, V], state)] after each step t (rows with n_new <= t unchanged)."""
  _, cfg, params = pair
  rng = np.random.default_rng(2)
  prefix = jnp.asarray(rng.integers(0, V, (4, T_BLOCK)), jnp.int32)
  block = jnp.asarray(rng.integers(0, V, (4, T_BLOCK)), jnp.int32)
  n_new = jnp.asarray([T_BLOCK, 1, 3, 0], jnp.int32)
  full = jnp.full((4,), T_BLOCK, jnp.int32)
  start = fwd(params, prefix, HybridState.init(cfg, 4, 32), full, cfg=cfg, mode="chunked", per_step=True)[2]
  state, seq = start, []
  for t in range(T_BLOCK):
    logits, _, state = fwd(params, block[:, t:t + 1], state, (n_new > t).astype(jnp.int32), cfg=cfg)
    seq.append((np.asarray(logits[:, 0]), state))
  return cfg, params, start, block, n_new, seq


def _assert_state_close(a: HybridState, b: HybridState, rows=slice(None), msg=""):
  np.testing.assert_array_equal(np.asarray(a.lengths)[rows], np.asarray(b.lengths)[rows], err_msg=msg)
  for x, y in zip(a.conv + a.rec, b.conv + b.rec):
    np.testing.assert_allclose(np.asarray(x)[rows], np.asarray(y)[rows], rtol=1e-4, atol=1e-5, err_msg=msg)


def test_hybrid_chunked_equals_recurrent(block_case):
  """On the whole model, with padding (n_new < T) and a carried state: one chunked pass and
  token-by-token decoding (the recurrent form) give the same logits at valid positions, the same
  state after the valid tokens, and the chunked pass's per-step states are the decoding's states."""
  cfg, params, start, block, n_new, seq = block_case
  logits, _, state, steps = fwd(params, block, start, n_new, cfg=cfg, mode="chunked", per_step=True)
  for t, (step_logits, step_state) in enumerate(seq):
    live = np.asarray(n_new) > t
    np.testing.assert_allclose(np.asarray(logits[:, t])[live], step_logits[live], **TOL)
    picked = jax.jit(rollback_per_step)(start, steps, jnp.full((4,), t + 1))
    _assert_state_close(picked, step_state, rows=live, msg=f"per-step state {t}")
  _assert_state_close(state, seq[-1][1])


@pytest.mark.parametrize("mode", ["per_step", "redecode"])
def test_rollback_restores_plain_state(block_case, mode):
  """Verify the whole block, then keep n_keep = (5, 1, 3, 0) of its tokens (all, one, a prefix,
  none): the rolled-back state (KV length, conv and recurrent states) equals the state after
  feeding just those tokens one at a time. The checkpoint is the old value `start`."""
  cfg, params, start, block, n_keep, seq = block_case
  full = jnp.full((4,), T_BLOCK, jnp.int32)
  _, _, after, steps = fwd(params, block, start, full, cfg=cfg, mode="chunked", per_step=True)
  if mode == "per_step":
    state = jax.jit(rollback_per_step)(start, steps, n_keep)
  else:
    state = jax.jit(rollback_redecode, static_argnums=1)(params, cfg, start, after, block, n_keep)
  _assert_state_close(state, seq[-1][1], msg=mode)
  # and the next token's logits from the rolled-back state are plain decoding's
  nxt, ones = jnp.asarray([[1], [2], [3], [4]], jnp.int32), jnp.ones((4,), jnp.int32)
  got = fwd(params, nxt, state, ones, cfg=cfg)[0][:, 0]
  want = fwd(params, nxt, seq[-1][1], ones, cfg=cfg)[0][:, 0]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


# ----------------------------------------------------------------------------------------------
# speculation on the hybrid target: greedy losslessness

TIE_TOL = 1e-4


@pytest.fixture(scope="module")
def noisy_drafter(pair):
  """A hybrid draft model: the target's parameters plus 5% Gaussian noise (sometimes right)."""
  _, cfg, params = pair
  return HybridDraftModelDrafter(cfg=cfg, max_draft=K, weights=perturb(params, DRAFT_SIGMA, seed=1))


def _assert_lossless(params, cfg, prompts, spec, plain, max_ties=1):
  """spec == plain, except where the target's top-two logits at the first differing step are
  within TIE_TOL (a float tie between the chunked and the recurrent form); at most max_ties."""
  ties = 0
  for i, (s, p) in enumerate(zip(spec, plain)):
    assert len(s) == len(p), f"sequence {i}: {len(s)} tokens vs {len(p)}"
    if s == p:
      continue
    j = next(t for t, (a, b) in enumerate(zip(s, p)) if a != b)
    ctx = jnp.asarray([prompts[i] + p[:j]], jnp.int32)
    logits = np.asarray(hybrid_forward(params, cfg, ctx, HybridState.init(cfg, 1, 64))[0])[0, -1]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] <= TIE_TOL, (
        f"sequence {i} differs from plain decoding at step {j} without a tie "
        f"(top-2 gap {top2[1] - top2[0]:.3g}):\nspec  {s}\nplain {p}")
    ties += 1
  assert ties <= max_ties, f"{ties} float ties: should be rare"


# Every pair of (rollback mode, drafter), (rollback mode, batch) and (drafter, batch) occurs: each
# run compiles its own loop (~5-10 s on CPU), the full 2 x 2 x 2 product doubles that for little.
GREEDY_RUNS = [("per_step", "draft", 3), ("redecode", "draft", 1), ("per_step", "ngram_simple", 1),
               ("redecode", "ngram_simple", 3)]


@pytest.mark.parametrize("rollback,drafter,batch", GREEDY_RUNS, ids=["-".join(map(str, r)) for r in GREEDY_RUNS])
def test_greedy_speculation_is_lossless(pair, noisy_drafter, plain3, rollback, drafter, batch):
  """Greedy speculative output equals plain greedy output on the hybrid target, with either
  rollback of its recurrent state: for a hybrid draft model right 20-90% of the time, and for
  ngram_simple (on the device; the host drafter's drafts), whose drafts are sometimes accepted
  and sometimes rejected (both sides of the rollback run); for 1 and 3 ragged sequences."""
  _, cfg, params = pair
  prompts = PROMPTS3[:batch]
  d = noisy_drafter if drafter == "draft" else NgramSimpleDevice(size_n=1, size_m=K)
  res = speculative_generate(params, cfg, prompts, d, rollback=rollback, max_new_tokens=MAX_NEW)
  st = res.stats
  if drafter == "draft":
    assert 0.2 <= st.acceptance_rate <= 0.9, f"acceptance {st.acceptance_rate:.3f}: must be sometimes right, sometimes wrong"
  assert 0 < st.acc_tokens < st.gen_tokens, st.format()
  assert st.rounds < sum(len(p) for p in plain3[:batch]), "speculation saved no target passes"
  _assert_lossless(params, cfg, prompts, res.tokens, plain3[:batch])


def test_adaptive_drafting_on_the_hybrid_target_is_lossless(pair, noisy_drafter, plain3):
  """Adaptive drafting (costs timed from whole rounds on the hybrid state, widths chosen per
  segment, then the recurrent state rolled back per step) keeps greedy output equal to plain."""
  from specjax.engine.adaptive import AdaptiveConfig
  _, cfg, params = pair
  ac = AdaptiveConfig(widths=(0, 2, K), segment_rounds=3)
  res = speculative_generate(params, cfg, PROMPTS3, noisy_drafter, max_new_tokens=MAX_NEW, adaptive=ac)
  assert res.stats.gen_tokens > 0, res.stats.format()
  _assert_lossless(params, cfg, PROMPTS3, res.tokens, plain3)


# ----------------------------------------------------------------------------------------------
# sampled losslessness: the law of the first generated tokens (the engine test, hybrid target)

N_SEQ = 4000


@pytest.fixture(scope="module")
def peaked(pair):
  """The hybrid target with its LM head scaled by 2 (lower-entropy laws: drafts get accepted at
  temperature 1), and the exact law P(t1, t2, t3) [V, V, V] of its first three sampled tokens."""
  from flax import nnx
  _, cfg, params = pair
  params = jax.tree_util.tree_map(lambda x: x, params)
  pure = nnx.to_pure_dict(params)
  pure["lm_head"]["kernel"] = pure["lm_head"]["kernel"] * 2.0
  nnx.replace_by_pure_dict(params, pure)
  exact = exact_joint_law(lambda seqs: fwd(params, seqs, HybridState.init(cfg, *seqs.shape), cfg=cfg)[0], V,
                          dict(temperature=1.0))
  return cfg, params, exact


@pytest.mark.parametrize("rollback", ["redecode"])   # "per_step" passes too; one mode keeps the file fast
def test_sampled_speculation_preserves_the_token_law(peaked, rollback):
  """4000 sequences with per-sequence seeds, 3 new tokens, temperature 1: the joint law of
  (t1, t2, t3) with speculation on the hybrid target (hybrid draft model) fits the exact law of
  plain sampling (chi-square p >= 1e-4) and agrees with plain samples; the statistic rejects
  plain samples at temperature 0.7 (p < 1e-12), so it has power."""
  cfg, params, exact = peaked
  drafter = HybridDraftModelDrafter(cfg=cfg, max_draft=3, weights=perturb(params, DRAFT_SIGMA, seed=2))
  seeds = list(range(10_000, 10_000 + N_SEQ))
  prompts = [STAT_PROMPT] * N_SEQ
  sampling = SamplingParams.make(N_SEQ, seed=seeds, temperature=1.0)
  spec = speculative_generate(params, cfg, prompts, drafter, rollback=rollback, max_new_tokens=STAT_NEW,
                                     sampling=sampling)
  assert 0.2 <= spec.stats.acceptance_rate <= 0.9, spec.stats.format()
  plain = generate_plain(params, cfg, prompts, max_new_tokens=STAT_NEW, sampling=sampling)
  colder = generate_plain(params, cfg, prompts, max_new_tokens=STAT_NEW,
                          sampling=SamplingParams.make(N_SEQ, seed=seeds, temperature=COLD_TEMPERATURE))
  check_token_law(exact, V, spec.tokens, plain.tokens, colder.tokens, what="speculative sampling (hybrid target)")


def test_api_and_cli_take_the_rollback_mode(hf_ckpt):
  """`api.generate(..., rollback=)` reaches the engine: both modes reproduce plain greedy output on a
  hybrid checkpoint loaded from disk, and an unknown mode is refused with a clear error."""
  from specjax import api
  from specjax.cli import main
  target = api.load(str(hf_ckpt[3]))
  kw = dict(chat=False, max_new_tokens=16, stop_at_eos=False)
  plain = api.generate(target, PROMPTS3[:2], **kw).tokens
  for mode in ("per_step", "redecode"):
    spec = api.generate(target, PROMPTS3[:2], speculator="ngram_simple", rollback=mode, **kw)
    assert spec.tokens == plain, mode
  with pytest.raises(ValueError, match="rollback"):
    api.generate(target, PROMPTS3[:1], speculator="ngram_simple", rollback="checkpoint", **kw)
  with pytest.raises(SystemExit):
    main(["generate", "--model", str(hf_ckpt[3]), "--spec", "ngram_simple", "--rollback", "checkpoint", "x"])
