"""KV cache properties: rollback by length is exact, ragged batches decode like single sequences,
and running out of cache slots is a clear `CacheOverflowError`, never silent corruption."""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from conftest import jit_forward
from specjax.engine.decode import generate_plain
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.engine import speculative_generate
from specjax.engine.sampling import SamplingParams
from specjax.models.kv_cache import CacheOverflowError, KVCache, check_capacity

ROLLBACK_TOL = 1e-5


def _rel_err(a, ref) -> float:
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


@pytest.fixture(params=["tiny_llama", "tiny_gemma"])
def model(request):
  """Both a full-attention model and one with sliding-window layers (window 5)."""
  return request.getfixturevalue(request.param)


def test_rollback_after_verification_equals_sequential_decode(model):
  """Prefill n=6 tokens, verify K=6 draft tokens in one forward, roll back with `with_lengths` to
  every length L in [1, n+K] (one row of the batch each), then feed a 3-token block: its logits
  equal those of decoding tokens[:L] + block one token at a time from an empty cache. The
  K-token verification logits themselves equal the one-by-one logits too."""
  cfg, params = model
  n, k, c = 6, 6, 3
  lengths = np.arange(1, n + k + 1, dtype=np.int32)                 # every rollback target
  r = len(lengths)
  rng = np.random.default_rng(0)
  seq = np.broadcast_to(rng.integers(0, cfg.vocab_size, (n + k,)), (r, n + k)).astype(np.int32)
  block = rng.integers(0, cfg.vocab_size, (r, c)).astype(np.int32)  # different continuation per row
  cap = 24

  # speculative path: prefill, K-token verification, rollback, continuation
  cache = KVCache.init(cfg, r, cap)
  _, _, cache = jit_forward(params, cfg, jnp.asarray(seq[:, :n]), cache)
  verify_logits, _, cache = jit_forward(params, cfg, jnp.asarray(seq[:, n:]), cache)
  assert np.asarray(cache.lengths).tolist() == [n + k] * r
  cache = cache.with_lengths(jnp.asarray(lengths))
  cont_logits, _, cache = jit_forward(params, cfg, jnp.asarray(block), cache)
  assert np.asarray(cache.lengths).tolist() == (lengths + c).tolist()

  # reference: one token at a time; row i feeds seq[:L_i] then its block
  ref_seq = np.zeros((r, n + k + c), np.int32)
  for i, length in enumerate(lengths):
    ref_seq[i, :length] = seq[i, :length]
    ref_seq[i, length:length + c] = block[i]
  ref_cache = KVCache.init(cfg, r, cap)
  step_logits = []
  for t in range(n + k + c):
    logits, _, ref_cache = jit_forward(params, cfg, jnp.asarray(ref_seq[:, t:t + 1]), ref_cache)
    step_logits.append(np.asarray(logits[:, 0]))
  step_logits = np.stack(step_logits, axis=1)                        # [R, n+K+C, V]

  for i, length in enumerate(lengths):
    ref = step_logits[i, length:length + c]
    err = _rel_err(cont_logits[i], ref)
    assert err <= ROLLBACK_TOL, f"rollback to L={length}: continuation logits differ (rel err {err:.3g})"
  # verification logits (rows whose reference prefix is the full seq up to n+K: the last row)
  err = _rel_err(verify_logits[-1], step_logits[-1, n:n + k])
  assert err <= ROLLBACK_TOL, f"K-token verification logits differ from one-by-one decode (rel err {err:.3g})"


RAGGED = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3, 5, 8], [9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2]]


def test_ragged_batch_greedy_decodes_like_alone(model):
  """Greedy `generate_plain` on a ragged batch of 3 prompts (3, 9, 17 tokens) gives each sequence
  exactly the 24 tokens it gets when decoded alone."""
  cfg, params = model
  batch = generate_plain(params, cfg, RAGGED, max_new_tokens=24).tokens
  for i, prompt in enumerate(RAGGED):
    alone = generate_plain(params, cfg, [prompt], max_new_tokens=24).tokens[0]
    assert len(alone) == 24
    assert batch[i] == alone, f"sequence {i} decodes differently in the batch"


def test_ragged_batch_sampling_budgets_and_stops_like_alone(tiny_llama):
  """Sampled decoding (temperature 1, per-sequence seeds) of a ragged batch with per-sequence
  budgets max_new=[5, 24, 13] and a stop token: each sequence's output is its solo output (same
  seed, full budget, no stop) cut at its budget and right after its first stop token."""
  cfg, params = tiny_llama
  seeds = [11, 22, 33]
  alone = [generate_plain(params, cfg, [p], max_new_tokens=24,
                          sampling=SamplingParams.make(1, temperature=1.0, seed=s)).tokens[0]
           for p, s in zip(RAGGED, seeds)]
  stop = alone[1][6]               # sequence 1 emits it at step 6 (maybe earlier too)
  budgets = [5, 24, 13]
  batch = generate_plain(params, cfg, RAGGED, max_new_tokens=24, max_new=budgets, stop_ids=(stop,),
                         sampling=SamplingParams.make(3, temperature=1.0, seed=seeds)).tokens
  for i in range(3):
    want = alone[i][:budgets[i]]
    if stop in want:
      want = want[:want.index(stop) + 1]
    assert batch[i] == want, f"sequence {i}: {batch[i]} != {want}"
  assert len(batch[1]) <= 7 and batch[1][-1] == stop


# ----------------------------------------------------------------------------------------------
# capacity


def _min_capacity(prompts, max_new: int, lookahead: int) -> int:
  """Smallest explicit capacity the planner accepts for these prompts (host-only search)."""
  from specjax.engine.generation import pad_prompts, plan_capacity
  width = pad_prompts(prompts)[0].shape[1]
  c = 1
  while True:
    try:
      plan_capacity(width, max_new, lookahead, c)
      return c
    except CacheOverflowError:
      c += 1


def test_forward_past_capacity_raises(tiny_llama):
  """`forward` with concrete lengths refuses to write past the cache's capacity (naming the
  length it would reach and the capacity); exactly filling it is allowed."""
  from specjax.models.decoder import forward
  cfg, params = tiny_llama
  cache = KVCache.init(cfg, 2, 8).with_lengths(jnp.asarray([3, 5]))
  with pytest.raises(CacheOverflowError, match=r"9 tokens.*holds 8"):
    forward(params, cfg, jnp.zeros((2, 4), jnp.int32), cache)               # 5 + 4 > 8
  check_capacity(cache.lengths, 3, cache.capacity)                          # 5 + 3 == 8: fits


def test_generate_plain_over_capacity_raises_clear_error(tiny_llama):
  """A prompt plus max_new_tokens that does not fit an explicit capacity raises CacheOverflowError
  before any work, naming the new tokens, the slots needed and the capacity."""
  cfg, params = tiny_llama
  need = _min_capacity([[1, 2, 3]], 40, 0)
  with pytest.raises(CacheOverflowError, match=rf"40 new tokens.*need {need} cache slots, capacity is {need - 1}"):
    generate_plain(params, cfg, [[1, 2, 3]], max_new_tokens=40, capacity=need - 1)


def test_generate_plain_at_exact_capacity_is_exact(tiny_llama):
  """With the smallest capacity the planner accepts, decoding is unchanged (nothing is dropped
  silently at the end of the cache) and every requested token is produced."""
  cfg, params = tiny_llama
  need = _min_capacity([RAGGED[2]], 24, 0)
  tight = generate_plain(params, cfg, [RAGGED[2]], max_new_tokens=24, capacity=need).tokens
  roomy = generate_plain(params, cfg, [RAGGED[2]], max_new_tokens=24).tokens
  assert len(tight[0]) == 24 and tight == roomy


def test_speculative_generate_counts_draft_lookahead(tiny_llama):
  """The engine reserves room for the K+1 verified tokens: a capacity enough for plain decoding
  but not for the draft lookahead raises CacheOverflowError mentioning the lookahead."""
  cfg, params = tiny_llama
  k = 4
  drafter = DraftModelDrafter(cfg=cfg, max_draft=k, weights=params)
  plain_need = _min_capacity([[1, 2, 3]], 40, 0)
  with pytest.raises(CacheOverflowError, match=rf"{k + 1} draft lookahead.*capacity is {plain_need + k}"):
    speculative_generate(params, cfg, [[1, 2, 3]], drafter, max_new_tokens=40, capacity=plain_need + k)
