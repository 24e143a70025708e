"""Parity of the specjax decoder with transformers (PyTorch CPU, float32).

Tiny random checkpoints of each family are built with transformers, saved as safetensors and
loaded with `specjax.models.load.load_model`; the real SmolLM2 GGUF is loaded by both. Properties:
prefill logits and step-by-step (KV-cached) decode logits agree to float32 tolerance
(max |diff| <= 1e-4 * max |logit|), and greedy continuations of 32 tokens are identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from conftest import HF_VOCAB, jit_forward
from specjax.engine.decode import generate_plain
from specjax.models.kv_cache import KVCache

REL_TOL = 1e-4
ARCHS = ["llama", "llama_tied", "qwen2", "gemma3", "qwen3", "mistral", "llama3_rope"]
PREFILL_LEN = 24          # > 2x the gemma3 sliding window (8)
N_NEW = 32


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
  import torch
  with torch.no_grad():
    return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
  import torch
  with torch.no_grad():
    out = model.generate(torch.as_tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def _rel_err(a, ref) -> float:
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def _assert_same_greedy(model, prompt, ours, theirs, tol=REL_TOL):
  """Identical greedy continuations. The only excuse for a divergence is a float tie: at the first
  differing step transformers' top-two logits must be within tol * max |logit|."""
  if ours == theirs:
    return
  j = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
  logits = _hf_logits(model, np.asarray([prompt + theirs[:j]]))[0, -1]
  top2 = np.sort(logits)[-2:]
  gap = float(top2[1] - top2[0])
  assert gap <= tol * np.abs(logits).max(), (
      f"greedy continuations diverge at step {j} without a tie (top-2 gap {gap:.3g}):\n"
      f"specjax      {ours}\ntransformers {theirs}")


def _prompts(batch: int, length: int, vocab: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)


# ----------------------------------------------------------------------------------------------
# configuration parsing


@pytest.mark.parametrize("arch", ARCHS)
def test_config_matches_transformers(hf_tiny, arch):
  """ModelConfig parsed from a transformers `config.json` has the same rotary bases (global and
  local), sliding window, per-layer attention types, head dim, query scale and tying as the
  transformers model actually uses (transformers >= 5 writes rotary bases under `rope_parameters`)."""
  pair = hf_tiny(arch)
  hc, cfg = pair.hf.config, pair.jx.cfg
  rp = hc.rope_parameters
  if "full_attention" in rp:        # per-layer-type rotary parameters (gemma3)
    want_theta, want_local = rp["full_attention"]["rope_theta"], rp["sliding_attention"]["rope_theta"]
  else:
    want_theta, want_local = rp["rope_theta"], None
  assert cfg.rope_theta == pytest.approx(want_theta), "global rotary base (rope_theta)"
  if want_local is not None:
    assert cfg.rope_local_theta == pytest.approx(want_local), "local rotary base of sliding layers"
  assert cfg.head_dim == hc.head_dim
  assert cfg.tie_embeddings == bool(hc.tie_word_embeddings)
  if arch == "gemma3":
    assert cfg.layer_types == ("sliding", "full", "sliding")
    assert cfg.sliding_window == hc.sliding_window == 8
    assert cfg.scale == pytest.approx(hc.query_pre_attn_scalar ** -0.5)
  else:
    assert set(cfg.layer_types) == {"full"}
    assert cfg.scale == pytest.approx(hc.head_dim ** -0.5)


# ----------------------------------------------------------------------------------------------
# logits parity


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(hf_tiny, arch):
  """Prefill logits of a batch of 2 prompts (24 tokens, longer than gemma3's window) agree with
  transformers to 1e-4 relative to the largest logit, at every position."""
  pair = hf_tiny(arch)
  ids = _prompts(2, PREFILL_LEN, HF_VOCAB, seed=1)
  ref = _hf_logits(pair.hf, ids)
  cache = KVCache.init(pair.jx.cfg, 2, 64)
  ours, _, cache = jit_forward(pair.jx.params, pair.jx.cfg, jnp.asarray(ids), cache)
  assert np.asarray(cache.lengths).tolist() == [PREFILL_LEN] * 2
  assert _rel_err(ours, ref) <= REL_TOL, f"prefill logits differ: rel err {_rel_err(ours, ref):.3g}"


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_logits_match_transformers(hf_tiny, arch):
  """Prefill of 6 tokens then 18 one-token KV-cached decode steps (teacher forced, crossing the
  sliding window) give, at each step, the logits transformers computes for that position."""
  pair = hf_tiny(arch)
  cfg, params = pair.jx.cfg, pair.jx.params
  ids = _prompts(2, PREFILL_LEN, HF_VOCAB, seed=2)
  ref = _hf_logits(pair.hf, ids)
  n0 = 6
  cache = KVCache.init(cfg, 2, 64)
  logits, _, cache = jit_forward(params, cfg, jnp.asarray(ids[:, :n0]), cache)
  steps = [np.asarray(logits)]
  for t in range(n0, PREFILL_LEN):
    logits, _, cache = jit_forward(params, cfg, jnp.asarray(ids[:, t:t + 1]), cache)
    steps.append(np.asarray(logits))
  ours = np.concatenate(steps, axis=1)
  for t in range(PREFILL_LEN):
    err = _rel_err(ours[:, t], ref[:, t])
    assert err <= REL_TOL, f"step {t}: decode logits differ from transformers, rel err {err:.3g}"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_continuation_matches_transformers(hf_tiny, arch):
  """`generate_plain` (greedy) and transformers' `generate(do_sample=False)` produce the same 32
  tokens from a 12-token prompt (the cache grows well past gemma3's sliding window)."""
  pair = hf_tiny(arch)
  prompt = _prompts(1, 12, HF_VOCAB, seed=3)[0].tolist()
  ours = generate_plain(pair.jx.params, pair.jx.cfg, [prompt], max_new_tokens=N_NEW).tokens[0]
  theirs = _hf_greedy(pair.hf, prompt, N_NEW)
  assert len(ours) == N_NEW
  _assert_same_greedy(pair.hf, prompt, ours, theirs)


def test_llama_attention_bias_is_loaded_or_refused(hf_tiny):
  """A llama checkpoint with `attention_bias=True` has biases on q/k/v *and* o_proj: specjax must
  either reproduce transformers' logits or refuse to load it -- never silently drop a tensor."""
  try:
    pair = hf_tiny("llama_attn_bias")
  except (KeyError, ValueError, NotImplementedError):
    return   # refused: acceptable
  ids = _prompts(1, 16, HF_VOCAB, seed=4)
  ref = _hf_logits(pair.hf, ids)
  ours, _, _ = jit_forward(pair.jx.params, pair.jx.cfg, jnp.asarray(ids), KVCache.init(pair.jx.cfg, 1, 64))
  assert _rel_err(ours, ref) <= REL_TOL, (
      f"llama with attention_bias loaded but logits differ (rel err {_rel_err(ours, ref):.3g}): "
      "a checkpoint tensor (self_attn.o_proj.bias) was silently ignored")


# ----------------------------------------------------------------------------------------------
# the real SmolLM2-135M-Instruct GGUF

REAL_PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314]   # "The capital of France is Paris. The capital of Germany is"


@pytest.mark.real
def test_real_smollm2_config(smollm2_jax, smollm2_hf):
  """The GGUF metadata gives the config transformers builds from the same file."""
  cfg, hc = smollm2_jax.cfg, smollm2_hf.config
  assert (cfg.arch, cfg.vocab_size, cfg.d_model, cfg.n_layers) == ("llama", hc.vocab_size, hc.hidden_size, hc.num_hidden_layers)
  assert (cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim) == (hc.num_attention_heads, hc.num_key_value_heads, hc.intermediate_size)
  assert cfg.rope_theta == pytest.approx(hc.rope_parameters["rope_theta"])
  assert cfg.norm_eps == pytest.approx(hc.rms_norm_eps)
  assert cfg.tie_embeddings == bool(hc.tie_word_embeddings)


@pytest.mark.real
def test_real_smollm2_prefill_and_decode_logits(smollm2_jax, smollm2_hf):
  """Real SmolLM2 (dequantized Q4_1 -> float32): prefill logits and 4 KV-cached decode steps agree
  with transformers to 1e-4 relative to the largest logit."""
  cfg, params = smollm2_jax.cfg, smollm2_jax.params
  ids = np.asarray([REAL_PROMPT + [11, 3575, 282]], np.int32)     # 15 tokens
  ref = _hf_logits(smollm2_hf, ids)
  n0 = ids.shape[1] - 4
  cache = KVCache.init(cfg, 1, 32)
  logits, _, cache = jit_forward(params, cfg, jnp.asarray(ids[:, :n0]), cache)
  err = _rel_err(logits, ref[:, :n0])
  assert err <= REL_TOL, f"prefill logits differ: rel err {err:.3g}"
  for t in range(n0, ids.shape[1]):
    logits, _, cache = jit_forward(params, cfg, jnp.asarray(ids[:, t:t + 1]), cache)
    err = _rel_err(logits[:, 0], ref[:, t])
    assert err <= REL_TOL, f"decode step {t}: rel err {err:.3g}"


@pytest.mark.real
def test_real_smollm2_greedy_continuation(smollm2_jax, smollm2_hf):
  """Real SmolLM2: `generate_plain` and transformers' greedy `generate` give the same 32 tokens."""
  ours = generate_plain(smollm2_jax.params, smollm2_jax.cfg, [REAL_PROMPT], max_new_tokens=N_NEW).tokens[0]
  theirs = _hf_greedy(smollm2_hf, REAL_PROMPT, N_NEW)
  assert len(ours) == N_NEW
  _assert_same_greedy(smollm2_hf, REAL_PROMPT, ours, theirs)




def test_row_product_two_rows_for_wide_matrices_same_values():
  """`layers.row_product`: a one-row product with a weight of TWO_ROW_MIN_ELEMENTS or more lowers to
  the two-row GEMM (its two optimization barriers) and equals the plain product; narrower weights
  and several rows lower to the plain product (no barrier)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from specjax.models import layers
  d_in, d_out = 512, layers.TWO_ROW_MIN_ELEMENTS // 512          # exactly at the threshold
  w = jax.random.normal(jax.random.key(0), (d_out, d_in), jnp.float32) * d_in ** -0.5   # [out, in]
  x = jax.random.normal(jax.random.key(1), (1, 1, d_in), jnp.float32)
  barriers = lambda x, w: jax.jit(layers.row_product).lower(x, w).as_text().count("optimization_barrier")
  assert barriers(x, w) == 2
  assert barriers(x, w[:-1]) == 0                                 # one row of weights under the threshold
  assert barriers(jnp.concatenate([x, x], axis=1), w) == 0       # two rows: a GEMM already
  want = jnp.einsum("...i,oi->...o", x, w, precision=jax.lax.Precision.HIGHEST)
  got = layers.row_product(x, w)
  assert got.shape == (1, 1, d_out) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
