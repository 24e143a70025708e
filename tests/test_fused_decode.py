"""The fused decoder-layer kernels (Pallas, interpret mode on the CPU) against the XLA layer.

Properties checked:
- one layer through `fused_block` equals `decoder.Block` (output and the K / V written) for llama,
  qwen2 (q/k/v bias), qwen3 (QK-norm), llama with o_proj bias and mistral (sliding window): decode
  (T = 1) and a 5-token tree verification over ragged lengths, d_model / ffn widths that are not
  powers of two; float32 to ~1e-5 relative, bf16 to bf16 rounding;
- each kernel over several row blocks and ragged column blocks equals its XLA expression (and the
  gelu_tanh activation, the (1 + w) norm weight);
- greedy decoding of a tiny random model, 16 steps, gives the XLA path's tokens;
- the switch: SPECJAX_FUSED_DECODE, unsupported configs and prefill-sized steps run `decoder.forward`;
- every kernel lowers to Triton for CUDA (SmolLM2-135M and Llama-3-8B layer shapes), on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_params
from specjax.kernels import fused_decode as fd
from specjax.models import fused_layer
from specjax.models.config import ModelConfig
from specjax.models.decoder import attention_masks, forward, model_of
from specjax.models.kv_cache import KVCache
from specjax.models.layers import rope, split_gate_up, split_qkv

# d_model 72 and ffn 80: not powers of two, as SmolLM2's 576 / 1536 are not
BASE = ModelConfig(arch="llama", vocab_size=64, d_model=72, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                   ffn_dim=80, rope_theta=10000.0, norm_eps=1e-5)
CONFIGS = {
    "llama": BASE,
    "qwen2-bias": BASE.replace(arch="qwen2", qkv_bias=True, n_heads=6, n_kv_heads=2),
    "qwen3-qknorm": BASE.replace(arch="qwen3", qk_norm=True, norm_eps=1e-6),
    "llama-obias-mha": BASE.replace(qkv_bias=True, o_bias=True, n_kv_heads=4),
    "mistral-sliding": BASE.replace(arch="mistral", sliding_window=6, layer_types=("sliding", "sliding")),
}
TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2e-2, atol=2e-2)}   # atol: x max |output|


def cast(params, dtype):
  return jax.tree_util.tree_map(lambda a: a.astype(dtype), params)


@functools.lru_cache(maxsize=None)
def params_of(name: str, dtype: str):
  return cast(random_params(CONFIGS[name], seed=3), jnp.dtype(dtype))


def layer_case(cfg, params, b, t, seed):
  """A cache with ragged committed lengths (random K/V), new tokens' hidden states and masks."""
  rng = np.random.default_rng(seed)
  cap = 24
  dtype = jax.tree_util.tree_leaves(params)[0].dtype
  cache = KVCache.init(cfg, b, cap, dtype)
  noise = lambda: jnp.asarray(rng.standard_normal(cache.k[0].shape), dtype)
  lengths = jnp.asarray(rng.integers(3, cap - t, b), jnp.int32)
  cache = KVCache(k=(noise(), noise()), v=(noise(), noise()), lengths=lengths)
  x = jnp.asarray(rng.standard_normal((b, t, cfg.d_model)), jnp.float32)         # [B, T, d_model]
  positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  tree = None
  if t > 1:   # a tree: node u's parent is u - 1 except node 3, a sibling of node 2
    anc = np.tril(np.ones((t, t), bool))
    anc[3, 2] = False
    tree = jnp.broadcast_to(jnp.asarray(anc), (b, t, t))
  return cache, x, positions, tree


@pytest.mark.parametrize("t", [1, 5], ids=["decode", "verify5"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_block_equals_xla_block(name, dtype, t):
  cfg = CONFIGS[name]
  params = params_of(name, dtype)
  cache, x, positions, tree = layer_case(cfg, params, b=3, t=t, seed=7)

  @functools.partial(jax.jit, static_argnames="fused")
  def layer(params, x, cache, positions, tree, fused):
    masks = attention_masks(cfg, cache.lengths, positions, cache.capacity, tree)
    block = model_of(params, cfg).layers[0]
    write = functools.partial(cache.write, 0)
    if fused:
      return fused_layer.fused_block(block, x, positions, write, masks, {})
    return block(x, positions, write, masks)

  (yf, (kf, vf)), (yx, (kx, vx)) = (layer(params, x, cache, positions, tree, fused) for fused in (True, False))
  scale = float(jnp.max(jnp.abs(yx)))
  np.testing.assert_allclose(np.asarray(yf), np.asarray(yx), rtol=TOL[dtype]["rtol"],
                             atol=TOL[dtype]["atol"] * scale)
  for got, want in ((kf, kx), (vf, vx)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOL[dtype])


TILINGS = {   # (tiling, rows)
    "dot-row-blocks": (fd.Tiling(block_m=64, block_n=16, block_k=16), 80),     # two row blocks, the second ragged
    "dot-one-step": (fd.Tiling(block_m=16, block_n=16, block_k=128), 5),       # the contraction in one load
    "row-sums-loop": (fd.Tiling(block_m=1, block_n=16, block_k=32, dot=False), 3),
    "row-sums-one-step": (fd.Tiling(block_m=1, block_n=32, block_k=128, dot=False), 2),
    "dot-unrolled": (fd.Tiling(block_m=16, block_n=16, block_k=32, unroll=True), 5),   # 3 blocks, the last ragged
    "row-sums-unrolled": (fd.Tiling(block_m=1, block_n=16, block_k=32, dot=False, unroll=True), 2),
}


@pytest.mark.parametrize("tiling", list(TILINGS))
def test_kernels_over_row_blocks_and_ragged_columns(tiling):
  """Each kernel against its XLA expression in float32 under every kind of tiling: tensor-core
  dots over row blocks, the contraction in one load (norm and product from the same tile), the
  one-row multiply-and-sum product, and the contraction unrolled (every block loaded first);
  16 / 32-wide tiles over ragged widths 72 / 80."""
  rng = np.random.default_rng(0)
  tl, m = TILINGS[tiling]
  d, f, h, kvh, hd = 72, 80, 4, 2, 32
  n = (h + 2 * kvh) * hd
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  x, nw, wqkv, bias = normal(m, d), 1 + 0.1 * normal(d), normal(n, d) / 8, normal(n)   # weights [out, in]
  pos = jnp.asarray(rng.integers(0, 500, (1, m)), jnp.int32)
  cos, sin = fused_layer.rope_tables(pos, hd, 10000.0)
  tol = dict(rtol=2e-5, atol=2e-5)

  xn = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * nw
  hp = jax.lax.Precision.HIGHEST
  q, k, v = split_qkv((jnp.dot(xn, wqkv.T, precision=hp) + bias)[None], h, kvh, hd)
  got = fd.norm_qkv_rope(x, nw, wqkv, cos, sin, eps=1e-5, offset=False, n_heads=h, n_kv_heads=kvh, head_dim=hd,
                         bias=bias, tiling=tl)
  gq, gk, gv = split_qkv(got[None], h, kvh, hd)
  np.testing.assert_allclose(np.asarray(gq), np.asarray(rope(q, pos, 10000.0)), **tol)
  np.testing.assert_allclose(np.asarray(gk), np.asarray(rope(k, pos, 10000.0)), **tol)
  np.testing.assert_allclose(np.asarray(gv), np.asarray(v), **tol)

  hin, wo, res = normal(m, h * hd), normal(d, h * hd) / 8, normal(m, d)
  np.testing.assert_allclose(np.asarray(fd.matmul_residual(hin, wo, res, nw, tiling=tl)),
                             np.asarray(res + (jnp.dot(hin, wo.T, precision=hp) + nw)), **tol)

  wgu = normal(2 * f, d) / 8
  g, u = split_gate_up(jnp.dot(xn, wgu.T, precision=hp))
  np.testing.assert_allclose(np.asarray(fd.norm_gate_up(x, nw, wgu, eps=1e-5, offset=False, tiling=tl)),
                             np.asarray(jax.nn.silu(g) * u), **tol)
  xn1 = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * (1 + nw)   # Gemma's (1 + w)
  g, u = split_gate_up(jnp.dot(xn1, wgu.T, precision=hp))
  np.testing.assert_allclose(np.asarray(fd.norm_gate_up(x, nw, wgu, eps=1e-5, offset=True, activation="gelu_tanh",
                                                        tiling=tl)),
                             np.asarray(jax.nn.gelu(g, approximate=True) * u), **tol)


@pytest.mark.parametrize("name", ["llama", "qwen3-qknorm"])
def test_greedy_decode_tokens_equal_the_xla_path(name):
  """Prefill 2 ragged prompts (XLA), then 16 greedy decode steps through each path."""
  cfg = CONFIGS[name]
  params = params_of(name, "float32")
  rng = np.random.default_rng(1)
  prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
  prefill = jax.jit(lambda p, x, c: forward(p, cfg, x, c, n_new=jnp.array([6, 4]), last_only=True))
  logits, _, cache0 = prefill(params, prompt, KVCache.init(cfg, 2, 32))
  first = jnp.argmax(logits[:, -1], axis=-1)                                     # [B]

  @functools.partial(jax.jit, static_argnames="fused")
  def decode(params, tok, cache, fused):
    def step(carry, _):
      tok, cache = carry
      logits, _, cache = fused_layer.forward(params, cfg, tok[:, None], cache, fused=fused)
      nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
      return (nxt, cache), (nxt, logits[:, -1])
    return jax.lax.scan(step, (tok.astype(jnp.int32), cache), None, length=16)[1]

  (tf, lf), (tx, lx) = decode(params, first, cache0, True), decode(params, first, cache0, False)
  np.testing.assert_array_equal(np.asarray(tf), np.asarray(tx))
  np.testing.assert_allclose(np.asarray(lf), np.asarray(lx), rtol=1e-4, atol=1e-4)


def test_engine_runs_the_fused_layer_under_the_switch_and_stays_lossless(monkeypatch):
  """SPECJAX_FUSED_DECODE=1: the engine's target is the fused one, its verification rounds trace
  through `fused_block`, and speculative greedy output equals plain greedy output (XLA layer)."""
  from specjax.drafters.ngram_device import NgramSimpleDevice
  from specjax.engine import speculative_generate
  from specjax.engine.decode import generate_plain
  from specjax.engine.generation import target_of
  from specjax.drafters.base import DraftParams
  cfg = CONFIGS["qwen2-bias"].replace(vocab_size=24)           # a small vocabulary: answers repeat, n-grams hit
  params = random_params(cfg, seed=5)
  prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6]]
  monkeypatch.delenv(fused_layer.FUSED_ENV, raising=False)
  want = generate_plain(params, cfg, prompts, max_new_tokens=12, capacity=96).tokens
  monkeypatch.setenv(fused_layer.FUSED_ENV, "1")
  assert isinstance(target_of(cfg), fused_layer.FusedDecoderTarget)
  traced = []
  real = fused_layer.fused_block
  monkeypatch.setattr(fused_layer, "fused_block", lambda *a, **k: traced.append(1) or real(*a, **k))
  out = speculative_generate(params, cfg, prompts, NgramSimpleDevice(2, 3, width=3), max_new_tokens=12,
                             capacity=96, draft_params=DraftParams(n_max=3))
  assert traced, "the fused layer was not traced"
  assert out.tokens == want and out.stats.gen_tokens > 0


def test_switch_and_fallbacks(monkeypatch):
  monkeypatch.delenv(fused_layer.FUSED_ENV, raising=False)
  assert not fused_layer.serves(BASE, 1)                                          # off by default
  monkeypatch.setenv(fused_layer.FUSED_ENV, "1")
  assert fused_layer.serves(BASE, 1) and fused_layer.serves(BASE, fd.MAX_ROWS)
  assert not fused_layer.serves(BASE, fd.MAX_ROWS + 1)                            # prefill: the XLA layer
  assert not fused_layer.serves(BASE, 1, fused=False)
  assert not fused_layer.serves(BASE.replace(invariant=True), 1)
  assert not fused_layer.serves(BASE.replace(head_dim=16), 1)
  gemma = BASE.replace(arch="gemma3", sandwich_norm=True, qk_norm=True, norm_offset=True)
  assert "sandwich" in fused_layer.unsupported(gemma)
  # an unsupported config through the module's forward is decoder.forward itself
  params = params_of("llama", "float32")
  calls = []
  monkeypatch.setattr(fused_layer, "fused_block", lambda *a, **k: calls.append(1))
  tokens = jnp.zeros((1, fd.MAX_ROWS + 1), jnp.int32)
  got = fused_layer.forward(params, BASE, tokens, KVCache.init(BASE, 1, 80))[0]
  want = forward(params, BASE, tokens, KVCache.init(BASE, 1, 80))[0]
  assert not calls
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# (d_model, heads, kv heads, head_dim, ffn)
EXPORT_SHAPES = {"smollm2-135m": (576, 9, 3, 64, 1536), "llama3-8b": (4096, 32, 8, 128, 14336)}


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("shape", list(EXPORT_SHAPES))
def test_kernels_lower_to_triton_for_cuda(shape, rows):
  """The Triton lowering (power-of-two tiles over non-power-of-two widths, the ops used) of each
  kernel, bf16 weights, with bias / QK-norm / gelu variants; runs on the CPU via export."""
  from jax import export
  from jax._src.lib import version as jaxlib_version
  if jaxlib_version > (0, 10, 2):
    pytest.skip("newer jaxlibs compile Triton at lowering time, which needs a GPU")
  d, h, kvh, hd, f = EXPORT_SHAPES[shape]
  n, m = (h + 2 * kvh) * hd, rows
  sds, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
  common = dict(eps=1e-5, offset=False, n_heads=h, n_kv_heads=kvh, head_dim=hd, interpret=False)
  qkv_args = [sds((m, d), f32), sds((d,), bf), sds((n, d), bf), sds((m, hd // 2), f32), sds((m, hd // 2), f32)]
  calls = [
      (lambda x, nw, w, c, s, b: fd.norm_qkv_rope(x, nw, w, c, s, bias=b, **common), qkv_args + [sds((n,), bf)]),
      (lambda x, nw, w, c, s, qn, kn: fd.norm_qkv_rope(x, nw, w, c, s, q_norm=qn, k_norm=kn, **common),
       qkv_args + [sds((hd,), bf), sds((hd,), bf)]),
      (lambda a, w, r, b: fd.matmul_residual(a, w, r, b, interpret=False),
       [sds((m, h * hd), f32), sds((d, h * hd), bf), sds((m, d), f32), sds((d,), bf)]),
      (lambda a, w, r: fd.matmul_residual(a, w, r, interpret=False),
       [sds((m, f), bf), sds((d, f), bf), sds((m, d), f32)]),
      (lambda x, nw, w: fd.norm_gate_up(x, nw, w, eps=1e-5, offset=False, interpret=False),
       [sds((m, d), f32), sds((d,), bf), sds((2 * f, d), bf)]),
      (lambda x, nw, w: fd.norm_gate_up(x, nw, w, eps=1e-6, offset=True, activation="gelu_tanh", interpret=False),
       [sds((m, d), f32), sds((d,), bf), sds((2 * f, d), bf)]),
  ]
  for fn, args in calls:
    exp = export.export(jax.jit(fn), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert "xla.gpu.triton" in exp.mlir_module()
