"""Tests of SuffixDecoding (specjax/drafters/suffix.py): trie counts and greedy walks against brute
force, crafted drafts, the global cache (FIFO), greedy losslessness through the engine, isolation."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from specjax.engine.decode import generate_plain
from specjax.drafters.suffix import SuffixDecoding, SuffixTrie, best_draft, greedy_path
from specjax.engine import speculative_generate
from specjax.models.config import ModelConfig
from specjax.models.decoder import init_params


def brute_count(seqs, s):
  n = len(s)
  return sum(1 for q in seqs for i in range(len(q) - n + 1) if q[i:i + n] == s)


def substrings(seqs, max_len):
  return {tuple(q[i:j]) for q in seqs for i in range(len(q)) for j in range(i + 1, min(i + max_len, len(q)) + 1)}


def check_walk(seqs, context_m, tokens, score, max_tokens, max_depth, min_prob):
  """`tokens` is a most-frequent-child walk after `context_m` with the right probabilities and stop."""
  prob, total, path = 1.0, 0.0, list(context_m)
  for t in tokens:
    parent = brute_count(seqs, path)
    kids = {c: brute_count(seqs, path + [c]) for c in {x for q in seqs for x in q}}
    assert kids[t] == max(kids.values()) > 0
    prob *= kids[t] / parent
    assert prob >= min_prob - 1e-9
    total += prob
    path.append(t)
  assert abs(total - score) < 1e-6
  if len(tokens) < max_tokens and len(path) < max_depth:      # stopped early: no child, or too unlikely
    kids = [brute_count(seqs, path + [c]) for c in {x for q in seqs for x in q}]
    best = max(kids, default=0)
    assert best == 0 or prob * best / brute_count(seqs, path) < min_prob + 1e-9   # (rounding at the boundary)


@settings(max_examples=80, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 2), min_size=3, max_size=40), min_size=1, max_size=4),
       depth=st.integers(2, 6), min_prob=st.sampled_from([0.0, 0.1, 0.4]))
@example(seqs=[[0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0], [0, 1, 1]], depth=3, min_prob=0.4)   # p = 2/3 * 6/10
def test_trie_counts_and_walks_match_brute_force(seqs, depth, min_prob):
  trie = SuffixTrie(depth)
  lists = [list(q) for q in seqs]
  for q in lists[:-1]:
    trie.extend(q)
  growing = []                                               # the last one token by token, as a request
  active = [trie.root]
  for pos, t in enumerate(lists[-1]):
    growing.append(t)
    active = trie.append(active, growing, pos)
  for s in substrings(lists, depth):
    assert trie.count(s) == brute_count(lists, list(s)), s
  assert trie.count([9]) == 0
  # the active list: materialised suffixes of the growing sequence, all occurring at least twice
  for m in range(1, len(active)):
    assert trie.count(growing[len(growing) - m:]) == active[m].count >= 2
  # walks from every matched suffix of some contexts
  for context in (lists[-1], lists[0], lists[0][:len(lists[0]) // 2]):
    states = trie.match(context)
    scores = []
    for m in range(1, len(states)):
      tokens, score = greedy_path(states[m], m, depth, 5, min_prob)
      check_walk(lists, context[len(context) - m:], tokens, score, 5, depth, min_prob)
      scores.append(greedy_path(states[m], m, depth, min(5, m), min_prob)[1])
    tokens, score, match_len = best_draft(states, depth, 5, 1.0, 0.0, min_prob)   # max_spec = m
    if scores:                                               # the best score; ties: the longest match
      assert score == max(scores) and match_len == max(m for m, s in enumerate(scores, 1) if s == score)
  # removal (FIFO eviction) leaves the counts of what remains
  if len(lists) > 1:
    trie.remove(lists[0])
    rest = lists[1:]
    for s in substrings(lists, depth):
      assert trie.count(s) == brute_count(rest, list(s)), s


def test_crafted_local_draft_and_score():
  d = SuffixDecoding(max_depth=8, max_cached_requests=0)
  h = [1, 2, 3, 4, 1, 2, 3]
  d.begin([h])
  tok, ln, score = d.propose([h], np.array([d.max_draft]))
  # "1 2 3" occurred twice (once now): 4 follows with p = 1/2, then its single continuation; 3 tokens
  # for a match of 3 (factor 1)
  assert tok[0, :ln[0]].tolist() == [4, 1, 2] and score[0] == pytest.approx(1.5)
  d = SuffixDecoding(max_depth=8, max_spec_offset=2, max_cached_requests=0)
  d.begin([h])
  tok, ln, score = d.propose([h], np.array([d.max_draft]))
  assert tok[0, :ln[0]].tolist() == [4, 1, 2, 3] and score[0] == pytest.approx(2.0)
  tok, ln, score = d.propose([h], np.array([2]))
  assert tok[0, :ln[0]].tolist() == [4, 1]
  d = SuffixDecoding(max_depth=8, min_token_prob=0.6, max_cached_requests=0)
  d.begin([h])
  assert d.propose([h], np.array([7]))[1][0] == 0


def test_defaults_and_shapes():
  d = SuffixDecoding()
  assert (d.max_depth, d.max_spec_tokens, d.max_spec_factor, d.max_spec_offset, d.min_token_prob,
          d.max_cached_requests) == (64, 64, 1.0, 0.0, 0.1, 100000)
  assert d.max_draft == 63 and d.name == "suffix" and d.on_device is False
  d.begin([[1], [2, 2]])
  tok, ln, score = d.propose([[1], [2, 2]], np.array([63, 63]))
  assert tok.shape == (2, 63) and ln.tolist() == [0, 1] and score.dtype == np.float32   # "2" then 2: p = 1/2
  with pytest.raises(ValueError):
    d.propose([[1]], np.array([3]))


def test_global_cache_fifo():
  d = SuffixDecoding(max_depth=16, max_cached_requests=2)
  out1, out2, out3 = [50, 51, 52, 53, 54, 55], [60, 61, 62, 63], [70, 71, 72]
  for prompt, out in [([1, 2], out1), ([3], out2)]:
    d.begin([prompt])
    d.propose([prompt + out], np.array([8]))                # the drafter has seen the output
  d.begin([[9, 50, 51]])                                     # the previous output is cached now
  assert d.n_cached_requests == 2
  tok, ln, score = d.propose([[9, 50, 51]], np.array([8]))
  # "50 51" matches the cached output once: its continuation with probability 1, 2 tokens (factor 1)
  assert tok[0, :ln[0]].tolist() == [52, 53] and score[0] == pytest.approx(2.0)
  d.propose([[9, 50, 51] + out3], np.array([8]))
  d.begin([[0]])                                             # out3 joins, out1 is evicted first
  assert d.n_cached_requests == 2
  assert d.global_trie.count([50, 51]) == 0 and d.global_trie.count([60, 61]) == 1
  assert d.global_trie.count([70, 71, 72]) == 1
  off = SuffixDecoding(max_depth=16, max_cached_requests=0)
  off.begin([[1]])
  off.propose([[1] + out1], np.array([8]))
  off.begin([[50, 51]])
  assert off.n_cached_requests == 0 and off.propose([[50, 51]], np.array([8]))[1][0] == 0


def test_long_history_is_fast():
  rng = np.random.default_rng(0)
  base = rng.integers(0, 32000, 1500).tolist()
  prompt = base + base[200:900] + rng.integers(0, 32000, 800).tolist()     # 3000 tokens, a long repeat
  d = SuffixDecoding()
  t0 = time.perf_counter()
  d.begin([prompt])
  h = list(prompt)
  for r in range(200):
    h += base[900 + r: 901 + r]                              # continue the repeat: long matches
    tok, ln, _ = d.propose([h], np.array([d.max_draft]))
    assert ln[0] > 0
  assert time.perf_counter() - t0 < 10.0                     # ~0.1 s unloaded


# ------------------------------------------------------------------------------------------------
# Through the engine

CFG = ModelConfig(arch="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
PROMPTS = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 8],
           [10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10]]
OTHER = [[20, 21, 22, 20, 21, 22, 20], [30, 31, 30, 31, 30, 31, 30, 31, 30], [40, 41, 42, 43, 40, 41]]
MAX_NEW = 40


def suffix(**kw):
  return SuffixDecoding(max_depth=16, max_spec_tokens=8, **kw)      # K = 8, as the other test files


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, 0)


@pytest.fixture(scope="module")
def reference(params):
  return {b: generate_plain(params, CFG, PROMPTS[-b:], max_new_tokens=MAX_NEW).tokens for b in (1, 3)}


def stats_of(res):
  s = dataclasses.asdict(res.stats)
  return {k: v for k, v in s.items() if k not in ("seconds", "draft_seconds")}


def test_greedy_lossless_through_engine(params, reference):
  d = suffix()
  for b in (1, 3):
    res = speculative_generate(params, CFG, PROMPTS[-b:], d, max_new_tokens=MAX_NEW)
    assert res.tokens == reference[b] and res.stats.name == "suffix"
    assert res.stats.acc_tokens > 0
  # the global trie now holds these outputs: a repeat of the request gets more accepted
  first = speculative_generate(params, CFG, PROMPTS, suffix(), max_new_tokens=MAX_NEW)
  again = speculative_generate(params, CFG, PROMPTS, d, max_new_tokens=MAX_NEW)
  assert again.tokens == reference[3]
  assert again.stats.acc_tokens > first.stats.acc_tokens


def test_requests_are_isolated_without_global_cache(params):
  shared = suffix(max_cached_requests=0)
  speculative_generate(params, CFG, OTHER, shared, max_new_tokens=MAX_NEW)
  after = speculative_generate(params, CFG, PROMPTS, shared, max_new_tokens=MAX_NEW)
  alone = speculative_generate(params, CFG, PROMPTS, suffix(max_cached_requests=0), max_new_tokens=MAX_NEW)
  assert after.tokens == alone.tokens
  assert stats_of(after) == stats_of(alone)
