"""The device ngram_simple drafter proposes exactly what the host NgramSimple proposes, and is
lossless through the engine's device loop."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from specjax.engine.decode import generate_plain
from specjax.drafters.base import DraftParams
from specjax.drafters.ngram_simple import NgramSimple
from specjax.drafters.ngram_device import NgramSimpleDevice, ngram_lookup
from specjax.engine import speculative_generate
from specjax.models.config import ModelConfig
from specjax.models.decoder import init_params


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 4), st.integers(1, 6),
       st.integers(0, 6))
def test_device_drafts_equal_host_drafts(history, size_n, size_m, budget):
  """Property: same draft tokens and lengths as the host implementation, for any history."""
  host = NgramSimple(size_n=size_n, size_m=size_m)
  host.begin([history[:1]])
  h_tok, h_len, _ = host.propose([history], np.array([budget]))
  buf = np.zeros((1, 64), np.int32)
  buf[0, :len(history)] = history
  d_tok, d_len = ngram_lookup(jnp.asarray(buf), jnp.asarray([len(history)]), size_n, size_m,
                              jnp.asarray([budget]), size_m)
  assert int(d_len[0]) == int(h_len[0])
  n = int(h_len[0])
  assert np.asarray(d_tok)[0, :n].tolist() == h_tok[0, :n].tolist()


def test_device_ngram_is_lossless_and_drafts():
  """Greedy output through the device loop equals plain decoding; some drafts are accepted."""
  cfg = ModelConfig(arch="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=8, ffn_dim=64)
  params = init_params(cfg, 3)
  prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7], [9, 8, 9, 8, 9, 8, 9]]
  ref = generate_plain(params, cfg, prompts, max_new_tokens=48)
  drafter = NgramSimpleDevice(size_n=2, size_m=6)
  out = speculative_generate(params, cfg, prompts, drafter, max_new_tokens=48,
                             draft_params=DraftParams(n_max=6))
  assert out.tokens == ref.tokens
  assert out.stats.acc_tokens > 0
