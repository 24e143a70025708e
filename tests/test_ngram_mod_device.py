"""The device ngram_mod drafter: same drafts and table as the host NgramMod through whole
generations, the table persists across requests by design, and greedy output stays lossless."""

import numpy as np

from specjax.engine.decode import generate_plain
from specjax.drafters.base import DraftParams
from specjax.drafters.ngram_mod import NgramMod
from specjax.drafters.ngram_mod_device import NgramModDevice
from specjax.engine import speculative_generate
from specjax.models.config import ModelConfig
from specjax.models.decoder import init_params

CFG = ModelConfig(arch="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
KW = dict(n_match=3, n_min=2, n_max=6, table_size=1 << 12, add_chunk=4)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [7, 8, 9, 7, 8, 9, 7], [3, 3, 4, 3, 3, 4, 3, 3]]


def test_device_ngram_mod_matches_host_and_is_lossless():
  """Property: per round, the device drafter makes the host drafter's decisions, so the whole
  generation's statistics and final table agree; outputs equal plain greedy decoding."""
  params = init_params(CFG, 5)
  ref = generate_plain(params, CFG, PROMPTS, max_new_tokens=40)
  dp = DraftParams(n_max=6)
  host, dev = NgramMod(**KW), NgramModDevice(**KW)
  for _ in range(2):                                     # second request reuses the shared table
    h = speculative_generate(params, CFG, PROMPTS, host, max_new_tokens=40, draft_params=dp)
    d = speculative_generate(params, CFG, PROMPTS, dev, max_new_tokens=40, draft_params=dp)
    assert d.tokens == ref.tokens == h.tokens
    assert (d.stats.gen_tokens, d.stats.acc_tokens, d.stats.rounds) == (h.stats.gen_tokens, h.stats.acc_tokens, h.stats.rounds)
    assert d.stats.drafted_by_pos == h.stats.drafted_by_pos
    np.testing.assert_array_equal(dev.table, host.table)
  assert d.stats.acc_tokens > 0
