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


def test_width_zero_rounds_run_as_plain_chunks_that_keep_the_table_learning():
  """Adaptive width 0 with ngram_mod: the rounds run as plain chunks (no draft proposed and dropped
  per round) whose chunk starts add the pending n-grams as a round's propose does, so after m steps
  the next full-width draft and the table equal those after m width-0 rounds; an adaptive run that
  backs off stays lossless."""
  import functools

  import jax
  import jax.numpy as jnp

  from specjax.engine import adaptive as adapt
  from specjax.engine.generation import pad_prompts
  from specjax.engine.loops import prefill_request, rounds_at
  from specjax.engine.plain_chunks import plain_chunks, supports
  from specjax.engine.round import RoundInputs, RoundSpec, draft_context
  from specjax.engine.sampling import SamplingParams

  params = init_params(CFG, 5)
  dev = NgramModDevice(**KW)
  b = len(PROMPTS)
  toks, lens = pad_prompts(PROMPTS)
  dp = {k: jnp.asarray(a) for k, a in DraftParams(n_max=6).arrays(b, 6).items()}
  inp = RoundInputs(params=params, dparams=dev.params(), sampling=SamplingParams.make(b), dp=dp,
                    stop_ids=jnp.asarray([-1], jnp.int32), max_new=jnp.full((b,), 40, jnp.int32))
  full, zero = RoundSpec(cfg=CFG, drafter=dev), RoundSpec(cfg=CFG, drafter=dev, width=0)
  assert supports(zero)
  m = 2 * (dev.max_draft + 1) + 1
  start = lambda: prefill_request(full, inp, jnp.asarray(toks), jnp.asarray(lens), capacity=64, history_len=64)
  by_rounds, _ = jax.jit(functools.partial(rounds_at, zero))(inp, m, start())
  by_chunks, _, ran = jax.jit(functools.partial(plain_chunks, zero))(inp, m, start())
  assert int(ran) == m and np.array_equal(by_rounds.state.history, by_chunks.state.history)
  propose = jax.jit(lambda cr: dev.propose(inp.dparams, cr.dstate, draft_context(full, inp, cr.state)))
  (want, ds_r), (got, ds_c) = propose(by_rounds), propose(by_chunks)
  assert np.array_equal(want.tokens, got.tokens) and np.array_equal(want.lengths, got.lengths)
  assert np.asarray(got.lengths).max() > 0
  np.testing.assert_array_equal(ds_r.table, ds_c.table)
  np.testing.assert_array_equal(ds_r.i_next, ds_c.i_next)

  ref = generate_plain(params, CFG, PROMPTS, max_new_tokens=40)
  ac = adapt.AdaptiveConfig(widths=(0, 2, 6), costs=(1.0, 50.0, 100.0), segment_rounds=4, explore_rounds=2,
                            explore_every=3)
  res = speculative_generate(params, CFG, PROMPTS, NgramModDevice(**KW), max_new_tokens=40, draft_params=DraftParams(n_max=6),
                             adaptive=ac)
  assert res.tokens == ref.tokens
  assert sum(n for w, n in res.stats.adaptive["segments"] if w == 0) >= max(res.stats.per_seq_rounds) / 2
