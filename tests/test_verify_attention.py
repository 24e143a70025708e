"""The verification-attention kernel (Pallas, interpret mode on the CPU) against the XLA reference.

Properties checked:
- the kernel's compact mask (lengths + mask among the new tokens) is exactly the dense [B, T, S]
  mask `decoder.attention_masks` builds, so dispatching to the kernel changes no visibility;
- kernel == reference on random inputs: ragged lengths (0 and a full cache included), K+1 chains
  for K = 0..16, random trees, GQA ratios 1..6, several splits / row blocks / a ragged last block,
  a single pass without splits, bf16 and f32;
- batch 1 under the split plan of a 132-SM GPU (many splits, splits without a block, an empty
  history) equals the reference; the plan fills the grid to 2x the SMs unless the cache bounds it;
- slots at or past length + T never enter the result (NaN there leaves the output finite and equal);
- a model forward through the kernel equals the forward through the reference (logits and cache);
- the dispatcher: reference on the CPU under auto, kernel when forced, reference for shapes the
  kernel does not take, and a kernel that fails to compile falls back with one warning;
- the kernel lowers to Triton for CUDA (SmolLM2 and Qwen2.5-1.5B head shapes), checked on the CPU.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_params
from specjax.kernels import verify_attention as va
from specjax.models.config import ModelConfig
from specjax.models.decoder import attention_masks, forward
from specjax.models.kv_cache import KVCache


def random_case(b, t, h, kvh, d, s_cap, dtype, *, tree: bool, seed: int, full_lengths: bool = True):
  rng = np.random.default_rng(seed)
  normal = lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  q = normal((b, t, h, d))                                                        # [B, T, H, D]
  k, v = normal((b, s_cap, kvh, d)), normal((b, s_cap, kvh, d))                   # [B, S, KVH, D]
  lengths = rng.integers(0, s_cap - t + 1, b)                                     # [B] ragged
  if full_lengths and b >= 2:   # the extremes: an empty history and a full cache
    lengths[0], lengths[1] = 0, s_cap - t
  if tree:   # a random tree: node u's parent is a random earlier node; visible = ancestors + self
    anc = np.zeros((b, t, t), bool)
    for i in range(b):
      for u in range(t):
        anc[i, u, u] = True
        if u > 0:
          anc[i, u] |= anc[i, rng.integers(0, u)]
  else:
    anc = np.tril(np.ones((b, t, t), bool))
  return q, k, v, va.RaggedMask(jnp.asarray(lengths, jnp.int32), jnp.asarray(anc))


def reference(q, k, v, ragged, scale):
  return va.attend_reference(q, k, v, va.dense_visibility(ragged, k.shape[1]), scale)


def tiling(b, t, h, kvh, d, s_cap, **override):
  import dataclasses
  return dataclasses.replace(va.tiling_for(b, t, h, kvh, d, s_cap), **override)


TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}

# (B, T, H, KVH, D, S, dtype, tree, tiling overrides)
CASES = [
    (3, 1, 4, 4, 16, 40, jnp.float32, False, dict(block_k=16, n_splits=2)),            # decode, MHA
    (2, 2, 9, 3, 64, 77, jnp.float32, False, dict(block_k=16, n_splits=3)),            # K=1, ragged tail
    (3, 5, 9, 3, 64, 150, jnp.bfloat16, False, {}),                                    # K=4, SmolLM2 heads
    (2, 9, 12, 2, 32, 100, jnp.float32, False, dict(block_k=32, n_splits=2)),          # K=8, G=6
    (2, 17, 12, 2, 32, 64, jnp.bfloat16, False, dict(block_k=16, n_splits=4)),         # K=16, G=6
    (2, 17, 6, 2, 16, 90, jnp.float32, False, dict(block_m=16, block_k=16, n_splits=2)),   # 4 row blocks
    (3, 12, 8, 2, 32, 120, jnp.float32, True, dict(block_k=32, n_splits=3)),           # tree, 12 nodes
    (2, 16, 9, 3, 64, 80, jnp.bfloat16, True, dict(block_k=16, n_splits=2)),           # tree, 16 nodes
    # a single pass (no split, nothing to merge): decode, a chain over row blocks, a tree
    (3, 1, 9, 3, 64, 200, jnp.float32, False, dict(block_k=32, n_splits=0)),           # decode, SmolLM2 heads
    (2, 17, 6, 2, 16, 90, jnp.float32, False, dict(block_m=16, block_k=16, n_splits=0)),   # K=16, 4 row blocks
    (3, 12, 8, 2, 32, 120, jnp.bfloat16, True, dict(block_k=32, n_splits=0)),          # tree, 12 nodes
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}KV{c[3]}D{c[4]}S{c[5]}"
                         f"{'-tree' if c[7] else ''}-{jnp.dtype(c[6]).name}")
def test_kernel_matches_reference(case):
  b, t, h, kvh, d, s_cap, dtype, tree, override = case
  q, k, v, ragged = random_case(b, t, h, kvh, d, s_cap, dtype, tree=tree, seed=sum(case[:6]))
  tl = tiling(b, t, h, kvh, d, s_cap, **override)
  got = jax.jit(functools.partial(va.pallas_verify_attention, scale=d ** -0.5, tiling=tl, interpret=True))(
      q, k, v, ragged)
  want = reference(q, k, v, ragged, d ** -0.5)
  assert got.shape == (b, t, h, d) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL[dtype], rtol=TOL[dtype])


# batch 1 with the split plan of a 132-SM GPU: many splits over a long cache, splits left without
# a block (length well below the capacity), an empty history, a tree
BATCH1 = [
    (1, 5, 4, 1, 16, 1500, 1490 - 5, jnp.float32, False),    # full cache, 24 splits of 64 slots
    (1, 9, 6, 2, 16, 1200, 150, jnp.bfloat16, False),       # 3 blocks over 19 splits: most idle
    (1, 17, 4, 2, 16, 900, 0, jnp.float32, False),          # empty history: only the new slots
    (1, 8, 8, 2, 32, 1000, 613, jnp.float32, True),         # a tree, ragged last block
]


@pytest.mark.parametrize("case", BATCH1, ids=lambda c: f"T{c[1]}KV{c[3]}S{c[5]}L{c[6]}{'-tree' if c[8] else ''}")
def test_batch1_split_plan_matches_reference(case):
  b, t, h, kvh, d, s_cap, length, dtype, tree = case
  q, k, v, ragged = random_case(b, t, h, kvh, d, s_cap, dtype, tree=tree, seed=s_cap + length)
  ragged = va.RaggedMask(jnp.full((b,), length, jnp.int32), ragged.new_mask)
  tl = va.tiling_for(b, t, h, kvh, d, s_cap, sm_count=132)
  assert tl.n_splits == -(-s_cap // tl.block_k) > 1          # the cache bounds the splits here
  got = jax.jit(functools.partial(va.pallas_verify_attention, scale=d ** -0.5, tiling=tl, interpret=True))(
      q, k, v, ragged)
  want = reference(q, k, v, ragged, d ** -0.5)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("heads", [(9, 3, 64), (12, 2, 128), (4, 1, 64)], ids=["smollm2", "qwen1.5b", "mqa"])
def test_split_plan_fills_the_gpu(heads):
  """Programs over the committed slots reach PROGRAMS_PER_SM x the SMs unless the cache (one block per split) or
  MAX_SPLITS bounds them; blocks of 64 slots only where 128 would leave the grid short; batch 1
  gets the most splits."""
  h, kvh, d = heads
  sms = 132
  for t in (1, 5, 9, 17):
    splits_by_batch = {}
    for b in (1, 2, 8, 32, 64):
      for ctx in (256, 1024, 4096, 16384, 65536):
        cap = ctx + 64
        tl = va.tiling_for(b, t, h, kvh, d, cap, sm_count=sms)
        programs = b * kvh * (tl.rows // tl.block_m) * tl.n_splits
        bounded = tl.n_splits in (-(-cap // tl.block_k), va.MAX_SPLITS)
        assert programs >= va.PROGRAMS_PER_SM * sms or bounded, (b, ctx, t, tl)
        assert programs < va.PROGRAMS_PER_SM * sms + b * kvh * (tl.rows // tl.block_m), (b, ctx, t, tl)   # no more than needed
        assert tl.block_k in (64, 128)
        if tl.block_k == 64 and tl.block_m * d < 8192:
          assert -(-cap // 128) < -(-va.PROGRAMS_PER_SM * sms // (b * kvh * (tl.rows // tl.block_m)))
        splits_by_batch.setdefault(ctx, []).append(tl.n_splits)
    for ctx, splits in splits_by_batch.items():
      assert splits == sorted(splits, reverse=True)
      assert ctx < 4096 or splits[0] > splits[-1]


def test_stale_slots_never_enter_the_result():
  b, t, h, kvh, d, s_cap = 3, 6, 6, 2, 32, 70
  q, k, v, ragged = random_case(b, t, h, kvh, d, s_cap, jnp.float32, tree=False, seed=7)
  stale = jnp.arange(s_cap)[None, :] >= (ragged.lengths + t)[:, None]             # [B, S]
  poison = lambda x: jnp.where(stale[:, :, None, None], jnp.nan, x)
  clean = lambda x: jnp.where(stale[:, :, None, None], 0.0, x)
  tl = tiling(b, t, h, kvh, d, s_cap, block_k=16, n_splits=3)
  got = jax.jit(functools.partial(va.pallas_verify_attention, scale=0.2, tiling=tl, interpret=True))(
      q, poison(k), poison(v), ragged)
  assert bool(jnp.all(jnp.isfinite(got)))
  want = reference(q, clean(k), clean(v), ragged, 0.2)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


SMALL = ModelConfig(arch="llama", vocab_size=64, d_model=96, n_layers=2, n_heads=6, n_kv_heads=2,
                    head_dim=16, ffn_dim=128, rope_theta=10000.0, norm_eps=1e-6)
SLIDING = ModelConfig(arch="gemma3", vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=16, ffn_dim=64, rope_theta=1e6, rope_local_theta=1e4, sliding_window=4,
                      layer_types=("sliding", "full"), tie_embeddings=True, qk_norm=True, sandwich_norm=True,
                      embed_scale=True, norm_offset=True, activation="gelu_tanh", query_scale=16 ** -0.5)


@pytest.mark.parametrize("tree", [False, True])
def test_ragged_mask_is_the_dense_mask(tree):
  b, t, s_cap = 4, 7, 30
  _, _, _, ragged = random_case(b, t, 4, 2, 16, s_cap, jnp.float32, tree=tree, seed=3)
  positions = ragged.lengths[:, None] + jnp.arange(t)[None, :]
  for cfg in (SMALL, SLIDING):
    @jax.jit
    def dense_pair(lengths, positions, new_mask):
      masks = attention_masks(cfg, lengths, positions, s_cap, new_mask if tree else None)
      return va.dense_visibility(masks["ragged"]["full"], s_cap), masks["full"], masks["ragged"]["sliding"]
    from_ragged, full, sliding = dense_pair(ragged.lengths, positions, ragged.new_mask)
    np.testing.assert_array_equal(np.asarray(from_ragged), np.asarray(full))
    assert (sliding is None) == bool(cfg.sliding_window)   # sliding-window layers keep the dense mask


@pytest.fixture
def impl():
  yield va.set_impl
  va.set_impl(None)


@pytest.mark.parametrize("cfg", [SMALL, SLIDING], ids=["llama", "gemma3-sliding"])
def test_forward_through_kernel_equals_reference(cfg, impl):
  params = random_params(cfg, seed=0)
  b, cap, t = 2, 48, 5
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, 20)), jnp.int32)
  prefill = jax.jit(lambda p, x, c: forward(p, cfg, x, c, n_new=jnp.array([20, 13]))[2])
  cache = prefill(params, prompt, KVCache.init(cfg, b, cap))                      # ragged lengths 20, 13
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
  tree = jnp.asarray(np.tril(np.ones((t, t), bool)) & ~np.eye(t, k=-2, dtype=bool))
  tree = jnp.broadcast_to(tree, (b, t, t))
  outs = {}
  for name in ("xla", "pallas"):
    impl(name)
    fwd = jax.jit(lambda p, x, c, m: forward(p, cfg, x, c, attn_mask=m))          # a new function: retraced
    outs[name] = fwd(params, tokens, cache, tree)
  (lx, _, cx), (lp, _, cp) = outs["xla"], outs["pallas"]
  np.testing.assert_allclose(np.asarray(lp), np.asarray(lx), atol=1e-4, rtol=1e-4)
  for a, c in zip(cp.k + cp.v, cx.k + cx.v):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(cp.lengths), np.asarray(cx.lengths))


def test_dispatch(impl, monkeypatch):
  q_shape, k_shape = (2, 5, 9, 64), (2, 100, 3, 64)
  ragged = va.RaggedMask(jnp.zeros((2,), jnp.int32), va.causal_new_mask(2, 5))
  impl(None)
  monkeypatch.delenv(va.IMPL_ENV, raising=False)
  assert va.choose(q_shape, k_shape, jnp.float32, ragged)[0] == "xla"            # auto on the CPU
  assert va.choose(q_shape, k_shape, jnp.float32, None)[0] == "xla"              # no ragged mask
  monkeypatch.setenv(va.IMPL_ENV, "pallas")
  assert va.choose(q_shape, k_shape, jnp.float32, ragged)[0] == "pallas"
  assert va.choose((2, 5, 9, 48), (2, 100, 3, 48), jnp.float32, ragged)[0] == "xla"        # head_dim 48
  assert va.choose((2, 300, 9, 64), (2, 400, 3, 64), jnp.float32,                          # prefill-sized T
                   va.RaggedMask(jnp.zeros((2,), jnp.int32), va.causal_new_mask(2, 300)))[0] == "xla"
  impl("xla")                                                                     # set_impl beats the env
  assert va.choose(q_shape, k_shape, jnp.float32, ragged)[0] == "xla"
  monkeypatch.setenv(va.IMPL_ENV, "bogus")
  impl(None)
  with pytest.raises(ValueError):
    va.choose(q_shape, k_shape, jnp.float32, ragged)


def test_kernel_that_fails_to_compile_falls_back_once(impl, monkeypatch, caplog):
  """Under auto on a 'GPU' whose compiler rejects the kernel (here: the CPU backend, which only
  runs Pallas in interpret mode), the reference is used and one warning is logged."""
  impl("auto")
  monkeypatch.setattr(va.dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(va.SWITCH, "probed", {})
  monkeypatch.setattr(va.SWITCH, "warned", set())
  q, k, v, ragged = random_case(2, 3, 4, 2, 16, 24, jnp.float32, tree=False, seed=5)
  mask = va.dense_visibility(ragged, 24)
  with caplog.at_level(logging.WARNING, logger=va.__name__):
    for _ in range(2):
      out = jax.jit(lambda q, k, v, m, r: va.attention(q, k, v, m, 0.25, r))(q, k, v, mask, ragged)
      np.testing.assert_allclose(np.asarray(out), np.asarray(va.attend_reference(q, k, v, mask, 0.25)), atol=1e-6)
  warnings = [r for r in caplog.records if "verify_attention kernel" in r.getMessage()]
  assert len(warnings) == 1 and "XLA reference" in warnings[0].getMessage()


@pytest.mark.parametrize("shape", [(8, 9, 9, 3, 64, 4160), (32, 17, 12, 2, 128, 16448), (1, 1, 9, 3, 64, 1088)],
                         ids=["smollm2-K8", "qwen1.5b-K16", "smollm2-decode"])
def test_kernel_lowers_to_triton_for_cuda(shape):
  """The Triton lowering (power-of-two blocks, supported primitives) runs on the CPU via export."""
  from jax import export
  from jax._src.lib import version as jaxlib_version
  if jaxlib_version > (0, 10, 2):
    pytest.skip("newer jaxlibs compile Triton at lowering time, which needs a GPU")
  b, t, h, kvh, d, s_cap = shape
  sds = jax.ShapeDtypeStruct
  ragged = va.RaggedMask(sds((b,), jnp.int32), sds((b, t, t), jnp.bool_))
  f = jax.jit(functools.partial(va.pallas_verify_attention, scale=d ** -0.5))
  exp = export.export(f, platforms=["cuda"],
                      disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
      sds((b, t, h, d), jnp.bfloat16), sds((b, s_cap, kvh, d), jnp.bfloat16), sds((b, s_cap, kvh, d), jnp.bfloat16),
      ragged)
  assert "xla.gpu.triton" in exp.mlir_module()


def test_probe_runs_inside_a_traced_loop_then_the_kernel_is_used(impl, monkeypatch):
  """Under auto on a GPU the first trace of a shape checks the kernel eagerly (here inside a
  jitted while_loop, as in the engine), records success, and the traced call uses the kernel."""
  impl("auto")
  monkeypatch.setattr(va.dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(va.SWITCH, "probed", {})
  calls = []

  def interpreted(*args, **kw):   # this CPU runs Pallas only in interpret mode
    calls.append(kw.get("tiling"))
    return va_kernel(*args, **{**kw, "interpret": True})

  va_kernel = va.pallas_verify_attention
  monkeypatch.setattr(va, "pallas_verify_attention", interpreted)
  q, k, v, ragged = random_case(2, 4, 6, 2, 16, 40, jnp.float32, tree=False, seed=11)
  mask = va.dense_visibility(ragged, 40)

  def loop(q, k, v, m, r):
    body = lambda i, acc: acc + va.attention(q, k, v, m, 0.25, r)
    return jax.lax.fori_loop(0, 2, body, jnp.zeros(q.shape, jnp.float32))

  out = jax.jit(loop)(q, k, v, mask, ragged)
  assert list(va.SWITCH.probed.values()) == [True]
  assert len(calls) == 2                                   # the probe's call and the traced call
  np.testing.assert_allclose(np.asarray(out), 2 * np.asarray(va.attend_reference(q, k, v, mask, 0.25)),
                             atol=1e-5, rtol=1e-5)
