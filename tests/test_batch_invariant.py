"""Batch-invariant mode (`ModelConfig.invariant`): a position's result does not depend on how many
rows are computed with it, so speculative greedy output equals plain greedy output in bf16.

The kernels run in Pallas interpret mode on the CPU. Properties checked, bitwise:
- matmul (`kernels.invariant_matmul`): rows computed alone (1 row), in 3 rows and inside 17 rows
  at any offset in their row block are equal; bf16, float32 (IEEE) and the transposed (tied LM
  head) weight; the product is the XLA product to rounding;
- RMSNorm (`kernels.invariant_rmsnorm`): the same for rows of a non-power-of-two width;
- attention (`kernels.invariant_attention`): a query decoded alone over the cache equals the same
  query inside a K+1 chain and, for a tree node, inside a tree verification whose nodes sit at
  other slots (its accepted path moved to consecutive slots for the decode), with and without a
  sliding window; close to the XLA reference;
- the three kernels lower to Triton for CUDA (checked on the CPU through export);
- the decoder (llama, and a gemma3-style config: tied head, QK-norm, sandwich norms, sliding
  layers): the logits of each position decoded one token at a time equal those of a K+1-token
  verification and of a tree verification (llama in bf16, gemma3 in float32);
- end to end in bf16: speculative greedy output of a chain speculator (ngram_simple, mtp with a
  random head) and a tree speculator (eagle3_tree with a random head) equals plain greedy output on
  every prompt of a ragged batch. Whether the default (XLA) mode differs on this CPU is printed;
- `api.load(invariant=...)`, SPECJAX_INVARIANT=1 and `api.batch_invariant` switch the mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_params
from specjax.drafters import speculator_spec
from specjax.drafters.base import DraftParams
from specjax.engine import speculative_generate
from specjax.engine.decode import generate_plain
from specjax.kernels import invariant_attention as ia
from specjax.kernels import invariant_matmul as im
from specjax.kernels import invariant_rmsnorm as irn
from specjax.kernels import verify_attention as va
from specjax.models.config import ModelConfig
from specjax.models.decoder import forward
from specjax.models.kv_cache import KVCache
from specjax.models.load import LoadedModel

LLAMA = ModelConfig(arch="llama", vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    ffn_dim=96, norm_eps=1e-6, invariant=True)
GEMMA = ModelConfig(arch="gemma3", vocab_size=64, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                    ffn_dim=64, rope_theta=1e6, rope_local_theta=1e4, sliding_window=6,
                    layer_types=("sliding", "full"), norm_eps=1e-6, tie_embeddings=True, qk_norm=True,
                    sandwich_norm=True, embed_scale=True, norm_offset=True, activation="gelu_tanh",
                    query_scale=16 ** -0.5, invariant=True)
# a tree of 7 nodes (node 0 = the last committed token); the path 0 -> 1 -> 3 -> 6 is "accepted"
PARENTS = (-1, 0, 0, 1, 1, 2, 3)
PATH = (0, 1, 3, 6)


def _rng(seed):
  return np.random.default_rng(seed)


def _bits_equal(a, b) -> bool:
  return np.array_equal(np.asarray(a), np.asarray(b))


def _ancestors(parents) -> tuple[np.ndarray, np.ndarray]:
  """([T, T] bool ancestors-and-self, [T] depth) of a parent list."""
  t = len(parents)
  anc, depth = np.zeros((t, t), bool), np.zeros(t, np.int32)
  for u, p in enumerate(parents):
    anc[u, u] = True
    if p >= 0:
      anc[u] |= anc[p]
      depth[u] = depth[p] + 1
  return anc, depth


# ----------------------------------------------------------------------------------------------
# kernels


@pytest.mark.parametrize("k,n,dtype,transposed", [(96, 64, jnp.bfloat16, False), (100, 48, jnp.float32, False),
                                                  (80, 40, jnp.bfloat16, True)],
                         ids=["bf16", "f32-ragged-k", "bf16-transposed-ragged-n"])
def test_matmul_row_alone_equals_row_in_a_block(k, n, dtype, transposed):
  rng = _rng(0)
  w = jnp.asarray(rng.standard_normal((n, k) if transposed else (k, n)), dtype)
  x = jnp.asarray(rng.standard_normal((17, k)), jnp.float32)
  mm = jax.jit(functools.partial(im.pallas_matmul, transposed=transposed))
  full = mm(x, w)                                                                 # [17, N]
  ref = im.matmul_reference(x, w, transposed=transposed)
  np.testing.assert_allclose(np.asarray(full), np.asarray(ref), rtol=1e-5, atol=1e-4)
  for m in (1, 3):
    for r0 in (0, 7, 14):    # first, middle and last rows of the first block, and the second block
      assert _bits_equal(mm(x[r0:r0 + m], w), full[r0:r0 + m]), (m, r0)
  assert _bits_equal(mm(x.reshape(1, 17, k), w)[0], full)                        # leading dims


@pytest.mark.parametrize("dtype,offset", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_rmsnorm_row_alone_equals_row_in_a_block(dtype, offset):
  rng = _rng(1)
  x = jnp.asarray(rng.standard_normal((17, 40)), dtype)
  wt = jnp.asarray(0.1 * rng.standard_normal(40), dtype)
  norm = jax.jit(lambda x, w: irn.rms_norm(x, w, 1e-6, offset=offset))
  full = norm(x, wt)
  xf = x.astype(jnp.float32)
  want = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6) * ((1.0 + wt) if offset else wt)
  np.testing.assert_allclose(np.asarray(full, np.float32), np.asarray(want.astype(dtype), np.float32),
                             rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6, atol=1e-5)
  for m, r0 in ((1, 0), (1, 16), (3, 9)):
    assert _bits_equal(norm(x[r0:r0 + m], wt), full[r0:r0 + m]), (m, r0)


@pytest.mark.parametrize("dtype,window", [(jnp.bfloat16, None), (jnp.float32, 40)], ids=["bf16", "f32-window"])
def test_attention_query_alone_equals_query_in_chain_and_tree(dtype, window):
  rng = _rng(2)
  b, h, kvh, d, s_cap, scale = 2, 6, 2, 16, 160, 0.25
  k = jnp.asarray(rng.standard_normal((b, s_cap, kvh, d)), dtype)
  v = jnp.asarray(rng.standard_normal((b, s_cap, kvh, d)), dtype)
  lengths = jnp.array([60, 127], jnp.int32)                                       # one block boundary apart
  attend = jax.jit(functools.partial(ia.invariant_attention, scale=scale, window=window))
  dense = lambda q, ragged: va.attend_reference(q, k, v, _windowed(va.dense_visibility(ragged, s_cap), ragged,
                                                                   window, q.shape[1]), scale)
  # a chain of 5 new tokens vs each decoded alone
  q = jnp.asarray(rng.standard_normal((b, 5, h, d)), jnp.float32)
  chain = attend(q, k, v, lengths, None)
  np.testing.assert_allclose(np.asarray(chain), np.asarray(dense(q, va.RaggedMask(lengths, va.causal_new_mask(b, 5)))),
                             atol=2e-2 if dtype == jnp.bfloat16 else 1e-5)
  for t in range(5):
    assert _bits_equal(attend(q[:, t:t + 1], k, v, lengths + t, None)[:, 0], chain[:, t]), t
  # a tree at slots L.. vs its path decoded from consecutive slots
  anc, depth = _ancestors(PARENTS)
  new_mask = jnp.asarray(np.broadcast_to(anc, (b,) + anc.shape))
  positions = lengths[:, None] + jnp.asarray(depth)[None, :]
  qt = jnp.asarray(rng.standard_normal((b, len(PARENTS), h, d)), jnp.float32)
  tree = attend(qt, k, v, lengths, positions, new_mask=new_mask)
  np.testing.assert_allclose(np.asarray(tree), np.asarray(dense(qt, va.RaggedMask(lengths, new_mask))),
                             atol=2e-2 if dtype == jnp.bfloat16 else 1e-5)
  rows = jnp.arange(b)[:, None]
  to, src = lengths[:, None] + jnp.arange(len(PATH))[None, :], lengths[:, None] + jnp.asarray(PATH)[None, :]
  kc, vc = k.at[rows, to].set(k[rows, src]), v.at[rows, to].set(v[rows, src])
  for i, u in enumerate(PATH):
    assert _bits_equal(attend(qt[:, u:u + 1], kc, vc, lengths + i, None)[:, 0], tree[:, u]), u


def _windowed(mask, ragged, window, t):
  """The dense mask with a sliding window over positions (the new tokens at lengths + depth)."""
  if window is None:
    return mask
  depth = jnp.sum(ragged.new_mask, axis=-1) - 1                                   # [B, T]
  pos = ragged.lengths[:, None] + depth                                           # [B, T]
  s_cap = mask.shape[-1]
  slot = jnp.arange(s_cap)[None, :]
  rel = slot - ragged.lengths[:, None]
  key_pos = jnp.where((rel >= 0) & (rel < t), jnp.take_along_axis(pos, jnp.clip(rel, 0, t - 1), axis=1), slot)
  return mask & ((pos[:, :, None] - key_pos[:, None, :]) < window)


def test_kernels_lower_to_triton_for_cuda():
  """The Triton lowering of the three kernels at SmolLM2's shapes (decode, a batch-8 K+1 chain, the
  tied LM head, float32, a 49-node tree with a window) runs on the CPU via export."""
  from jax import export
  from jax._src.lib import version as jaxlib_version
  if jaxlib_version > (0, 10, 2):
    pytest.skip("newer jaxlibs compile Triton at lowering time, which needs a GPU")
  sds, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32

  def lowers(f, *args):
    exp = export.export(jax.jit(f), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert "xla.gpu.triton" in exp.mlir_module()

  mm = functools.partial(im.pallas_matmul, interpret=False)
  lowers(mm, sds((1, 1, 576), f32), sds((576, 960), bf))
  lowers(mm, sds((8, 9, 1536), f32), sds((1536, 576), bf))
  lowers(functools.partial(mm, transposed=True), sds((1, 1, 576), f32), sds((49152, 576), bf))
  lowers(mm, sds((3, 576), f32), sds((576, 960), f32))
  lowers(lambda x, w: irn.rms_norm(x, w, 1e-5, interpret=False), sds((1, 9, 576), f32), sds((576,), bf))
  lowers(lambda x, w: irn.rms_norm(x, w, 1e-5, offset=True, interpret=False), sds((1, 9, 4, 64), f32), sds((64,), bf))
  cache = sds((2, 1088, 3, 64), bf)
  lowers(lambda q, k, v, n: ia.invariant_attention(q, k, v, n, None, 0.125, interpret=False),
         sds((2, 1, 9, 64), f32), cache, cache, sds((2,), jnp.int32))
  tree = functools.partial(ia.invariant_attention, scale=0.125, window=512, interpret=False)
  lowers(lambda q, k, v, n, p, m: tree(q, k, v, n, p, new_mask=m),
         sds((2, 49, 9, 64), f32), cache, cache, sds((2,), jnp.int32), sds((2, 49), jnp.int32), sds((2, 49, 49), jnp.bool_))


# ----------------------------------------------------------------------------------------------
# the decoder


@functools.partial(jax.jit, static_argnames=("cfg",))
def _fwd(params, tokens, cache, positions=None, attn_mask=None, *, cfg):
  return forward(params, cfg, tokens, cache, positions=positions, attn_mask=attn_mask)


def _params(cfg, dtype, seed=0):
  return jax.tree_util.tree_map(lambda x: x.astype(dtype), random_params(cfg, seed))


@pytest.mark.parametrize("cfg,dtype", [(LLAMA, jnp.bfloat16), (GEMMA, jnp.float32)], ids=["llama-bf16", "gemma3-f32"])
def test_decoder_logits_decode_equal_chain_and_tree_verification(cfg, dtype):
  params = _params(cfg, dtype)
  rng = _rng(3)
  b, cap, n_prompt = 2, 48, 13
  prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, n_prompt)), jnp.int32)
  _, _, cache = _fwd(params, prompt, KVCache.init(cfg, b, cap, dtype=dtype), cfg=cfg)
  t = len(PARENTS)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)       # [last, nodes...]
  # decode the path 0 -> 1 -> 3 -> 6 one token at a time
  path = tokens[:, jnp.asarray(PATH)]
  decoded, c = [], cache
  for i in range(len(PATH)):
    logits, _, c = _fwd(params, path[:, i:i + 1], c, cfg=cfg)
    decoded.append(logits[:, 0])
  chain, _, _ = _fwd(params, path, cache, cfg=cfg)                                 # K+1 = 4 tokens
  anc, depth = _ancestors(PARENTS)
  tree, _, _ = _fwd(params, tokens, cache, positions=cache.lengths[:, None] + jnp.asarray(depth)[None, :],
                    attn_mask=jnp.asarray(np.broadcast_to(anc, (b, t, t))), cfg=cfg)
  for i, u in enumerate(PATH):
    assert _bits_equal(chain[:, i], decoded[i]), f"chain position {i}"
    assert _bits_equal(tree[:, u], decoded[i]), f"tree node {u}"
  # and the invariant forward is the model: close to the default (XLA) forward
  default = cfg.replace(invariant=False)
  want, _, _ = _fwd(params, path, cache, cfg=default)
  np.testing.assert_allclose(np.asarray(chain), np.asarray(want), atol=0.1 if dtype == jnp.bfloat16 else 1e-4)


# ----------------------------------------------------------------------------------------------
# end to end

PROMPTS = [[1, 5, 9, 3, 5, 9, 3, 5, 9, 3], [2, 4, 6, 2, 4, 6, 2, 4], [7, 7, 1, 2, 7, 7, 1, 2, 7, 7, 1]]
MAX_NEW = 16
SPECULATORS = {"ngram_simple": 4, "mtp": 2, "eagle3_tree": 6}     # name -> n_max (a tree: its depth bound)


@pytest.fixture(scope="module")
def bf16_target():
  cfg = LLAMA.replace(n_layers=1)    # one layer: compiling the interpret-mode kernels is the test's cost
  params = _params(cfg, jnp.bfloat16, seed=5)
  # a peaked head (x4) so that repeated n-grams are continued and drafts are accepted
  params["lm_head"]["kernel"][...] = params["lm_head"]["kernel"][...] * 4
  return LoadedModel(name="tiny", cfg=cfg, params=params)


@pytest.fixture(scope="module")
def plain_greedy(bf16_target):
  """Plain greedy output in invariant mode and in the default mode."""
  default = bf16_target.cfg.replace(invariant=False)
  return {mode: generate_plain(bf16_target.params, cfg, PROMPTS, max_new_tokens=MAX_NEW).tokens
          for mode, cfg in (("invariant", bf16_target.cfg), ("default", default))}


def _run(name, target, tmp_path):
  spec = speculator_spec.get(name)
  dp = DraftParams(n_max=SPECULATORS[name])
  drafter = spec.build(target, draft_params=dp, **(spec.example(target, tmp_path) if spec.example else {}))
  out = speculative_generate(target.params, target.cfg, PROMPTS, drafter, max_new_tokens=MAX_NEW, draft_params=dp)
  return out.tokens, out.stats.gen_tokens


@pytest.mark.parametrize("name", list(SPECULATORS))
def test_speculative_greedy_equals_plain_greedy_in_bf16(name, bf16_target, plain_greedy, tmp_path):
  tokens, drafted = _run(name, bf16_target, tmp_path)
  assert drafted > 0, f"{name} drafted nothing: the check would be vacuous"
  assert tokens == plain_greedy["invariant"]
  # informative: the default mode on this CPU (bf16 XLA matmuls); not a failure either way
  default = LoadedModel(name="tiny", cfg=bf16_target.cfg.replace(invariant=False), params=bf16_target.params)
  d_tokens, _ = _run(name, default, tmp_path)
  same = sum(a == b for a, b in zip(d_tokens, plain_greedy["default"]))
  print(f"\n[default mode, CPU, bf16] {name}: {same}/{len(PROMPTS)} prompts equal to plain greedy")


# ----------------------------------------------------------------------------------------------
# switching it on


def test_load_and_batch_invariant_switch_the_mode(monkeypatch):
  from specjax import api
  from specjax.errors import UserError
  tiny = LoadedModel(name="tiny", cfg=LLAMA.replace(invariant=False), params=None)
  monkeypatch.setattr(api, "load_model", lambda name, dtype: tiny)
  monkeypatch.delenv(api.INVARIANT_ENV, raising=False)
  assert not api.load("tiny-path").cfg.invariant
  assert api.load("tiny-path", invariant=True).cfg.invariant
  monkeypatch.setenv(api.INVARIANT_ENV, "1")
  assert api.load("tiny-path").cfg.invariant
  assert not api.load("tiny-path", invariant=False).cfg.invariant
  on = api.batch_invariant(tiny)
  assert on.cfg.invariant and not api.batch_invariant(on, False).cfg.invariant and on.params is tiny.params
  with pytest.raises(UserError, match="one device"):
    api.batch_invariant(LoadedModel(name="tiny", cfg=tiny.cfg, params=None, mesh=object()))
