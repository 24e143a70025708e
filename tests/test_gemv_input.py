"""The vector-matrix input barrier of `specjax.models.layers.matmul_input`.

Properties: a one-token forward at batch 1 puts one optimization barrier before every projection
(QKV, output, gate/up, down: 4 per layer) and a forward of several tokens puts none (its products
go to GEMM kernels); and the barrier changes no value: with it and without it, a batch-1 greedy
decode gives the same tokens and logits equal to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.engine.decode import generate_plain
from specjax.models import layers
from specjax.models.decoder import forward
from specjax.models.kv_cache import KVCache


def _lowered_barriers(cfg, params, t: int) -> int:
  cache = KVCache.init(cfg, 1, 32, dtype=jnp.float32)
  tokens = jnp.ones((1, t), jnp.int32)
  text = jax.jit(lambda p, tok, c: forward(p, cfg, tok, c)[0]).lower(params, tokens, cache).as_text()
  return text.count("optimization_barrier")


def test_one_row_products_get_a_barrier_and_wider_ones_none(tiny_llama, tiny_gemma):
  for cfg, params in (tiny_llama, tiny_gemma):
    assert _lowered_barriers(cfg, params, 1) == 4 * cfg.n_layers
    assert _lowered_barriers(cfg, params, 4) == 0


def test_barrier_changes_no_value(tiny_llama, monkeypatch):
  cfg, params = tiny_llama
  prompt = [[3, 7, 1, 12, 5, 9]]

  def run():
    jax.clear_caches()
    out = generate_plain(params, cfg, prompt, max_new_tokens=12, capacity=128)
    cache = KVCache.init(cfg, 1, 64, dtype=jnp.float32)
    _, _, cache = forward(params, cfg, jnp.asarray(prompt, jnp.int32), cache)
    logits, _, _ = forward(params, cfg, jnp.asarray([[4]], jnp.int32), cache)
    return out.tokens, np.asarray(logits)

  monkeypatch.setattr(layers, "GEMV_BARRIER", True)
  tokens_on, logits_on = run()
  monkeypatch.setattr(layers, "GEMV_BARRIER", False)
  tokens_off, logits_off = run()
  jax.clear_caches()
  assert tokens_on == tokens_off
  np.testing.assert_allclose(logits_on, logits_off, rtol=1e-6, atol=1e-6)
