"""Tests of the n-gram host speculators (specjax/drafters/ngram_*.py): crafted histories, a
hypothesis property of NgramSimple, greedy losslessness through the engine, request isolation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from specjax.engine.decode import generate_plain
from specjax.drafters.ngram_cache import (NgramCache, build_static_cache, load_ngram_cache, save_ngram_cache,
                                          update_ngram_counts)
from specjax.drafters.ngram_index import EMPTY
from specjax.drafters.ngram_map import NgramMapK, NgramMapK4V
from specjax.drafters.ngram_mod import NgramMod, ngram_mod_hash, ngram_mod_lookup
from specjax.drafters.ngram_simple import NgramSimple
from specjax.engine import speculative_generate
from specjax.models.config import ModelConfig
from specjax.models.decoder import init_params


def draft_of(drafter, history, n_max=None):
  """One propose for one sequence -> the draft as a list."""
  tok, ln, _ = drafter.propose([history], np.array([drafter.max_draft if n_max is None else n_max]))
  assert tok.shape == (1, drafter.max_draft) and tok.dtype == np.int32
  return tok[0, :ln[0]].tolist()


# ------------------------------------------------------------------------------------------------
# ngram_simple


def test_simple_defaults_and_basic_match():
  d = NgramSimple()
  assert (d.size_n, d.size_m, d.max_draft, d.on_device, d.name) == (12, 48, 48, False, "ngram_simple")
  d = NgramSimple(size_n=3, size_m=4)
  h = [1, 2, 3, 4, 5, 1, 2, 3]
  d.begin([h])
  assert draft_of(d, h) == [4, 5, 1, 2]
  assert draft_of(d, h, n_max=1) == [4]
  assert draft_of(d, h, n_max=0) == []


def test_simple_edge_cases():
  d = NgramSimple(size_n=3, size_m=4)
  d.begin([[1, 2]])
  assert draft_of(d, [1, 2]) == []                            # history shorter than the key
  d.begin([[1, 2, 3, 4, 5, 6]])
  assert draft_of(d, [1, 2, 3, 4, 5, 6]) == []                # no earlier occurrence
  d.begin([[1, 7, 7, 7, 7]])
  assert draft_of(d, [1, 7, 7, 7, 7]) == []                   # the earlier key has < size_n tokens after it
  d.begin([[1, 2, 3, 9, 1, 2, 3]])
  assert draft_of(d, [1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2, 3]   # a continuation may run into the key
  # short period: the most recent occurrence is too close, an earlier one is used
  d = NgramSimple(size_n=2, size_m=4)
  d.begin([[7, 7, 7, 7, 7]])
  assert draft_of(d, [7, 7, 7, 7, 7]) == [7, 7]


def test_simple_batch_padding_and_errors():
  d = NgramSimple(size_n=2, size_m=5)
  hs = [[1, 2, 3, 1, 2], [4, 4], [5, 6, 7, 8, 5, 6]]
  d.begin(hs)
  tok, ln, score = d.propose(hs, np.array([5, 5, 1]))
  assert score is None and tok.shape == (3, 5)
  assert ln.tolist() == [3, 0, 1] and tok[0].tolist() == [3, 1, 2, 0, 0] and tok[2, 0] == 7
  with pytest.raises(ValueError):
    d.propose(hs[:2], np.array([5, 5]))                     # batch differs from begin()
  with pytest.raises(ValueError):
    d.propose([[9, 9, 9, 9, 9, 9], hs[1], hs[2]], np.array([5, 5, 5]))   # not an extension


def brute_force_simple(h, n, m, budget):
  min_len = min(n, m)
  if len(h) < n:
    return []
  js = [j for j in range(len(h) - n) if h[j:j + n] == h[len(h) - n:] and len(h) - (j + n) >= min_len]
  return h[js[-1] + n: js[-1] + n + min(m, budget)] if js else []


@settings(max_examples=150, deadline=None)
@given(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=30),
       steps=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=5),
       n=st.integers(1, 4), m=st.integers(1, 6), budget=st.integers(0, 6))
def test_simple_property(prompt, steps, n, m, budget):
  """Every draft is a continuation found in the history right after an earlier occurrence of the
  key (the most recent one with enough tokens after it), and one is found whenever one exists."""
  d = NgramSimple(size_n=n, size_m=m)
  d.begin([prompt])
  h = list(prompt)
  for new in [[]] + steps:
    h += new
    draft = draft_of(d, h, budget)
    assert draft == brute_force_simple(h, n, m, budget)
    if draft:
      key = h[len(h) - n:]
      assert any(h[j:j + n] == key and h[j + n:j + n + len(draft)] == draft for j in range(len(h) - n))
      assert len(draft) >= min(n, m, budget)


# ------------------------------------------------------------------------------------------------
# ngram_map_k / ngram_map_k4v


def test_map_k_caps_by_last_acceptance():
  d = NgramMapK(size_n=2, size_m=3)
  assert NgramMapK().size_n == 12 and NgramMapK().max_draft == 48
  h = [1, 2, 3, 4, 5, 9, 1, 2]
  d.begin([h])
  assert draft_of(d, h) == [3, 4, 5]
  d.accept(np.array([1]), verified=np.array([False]))        # not verified: nothing learnt
  assert draft_of(d, h) == [3, 4, 5]
  d.accept(np.array([1]))
  assert draft_of(d, h) == [3]                               # capped by last acceptance
  assert d._states[0].keys[(1, 2)].hits == 3
  d.begin([h])                                                # a new request starts afresh
  assert draft_of(d, h) == [3, 4, 5]


def test_map_k_needs_full_value():
  h = [1, 2, 3, 1, 2]                                         # 3 tokens follow the earlier key
  d = NgramMapK(size_n=2, size_m=4)
  d.begin([h])
  assert draft_of(d, h) == []                                 # a key counts with a full m-gram only
  s = NgramSimple(size_n=2, size_m=4)
  s.begin([h])
  assert draft_of(s, h) == [3, 1, 2]


def test_k4v_contested_and_winner():
  a, b = [5, 6], [7, 8]
  key = [1, 2]
  # key followed by a twice and b once: 2 < 3 * 1 -> contested, no draft
  h = key + a + key + b + key + a + key
  d = NgramMapK4V(size_n=2, size_m=2)
  d.begin([h])
  assert draft_of(d, h) == []
  # a three times, b once (the most recent): 3 >= 3 -> draft a, not the most recent value b
  h = key + a + key + a + key + a + key + b + key
  d.begin([h])
  assert draft_of(d, h) == a
  ks = d._states[0].keys[tuple(key)]
  assert {v: c for v, (c, _) in ks.values.items()} == {tuple(a): 3, (7, 8): 1}
  d.accept(np.array([1]))
  assert draft_of(d, h) == a[:1]                              # value capped by its last acceptance
  assert ks.values[tuple(a)][0] == 3                          # occurrences are counted once


def test_k4v_min_hits_and_value_slots():
  key, h = [1, 2], []
  for v in range(6):                                          # six distinct values: four are kept
    h += key + [10 + v, 20 + v]
  h += key + [10, 20] + key
  d = NgramMapK4V(size_n=2, size_m=2, min_hits=2)
  d.begin([h])
  assert draft_of(d, h) == []                                 # first hit < min_hits
  assert draft_of(d, h) == []                                 # second hit: contested (2 vs 3)
  assert len(d._states[0].keys[tuple(key)].values) == 4


# ------------------------------------------------------------------------------------------------
# ngram_mod


def test_mod_hash_numpy_jax_and_rolling_agree():
  rng = np.random.default_rng(0)
  table = rng.integers(-1, 50, size=(1 << 10,)).astype(np.int32)
  windows = rng.integers(0, 50000, size=(7, 5)).astype(np.int32)
  idx_np = ngram_mod_hash(windows, table.shape[0])
  idx_jnp = np.asarray(ngram_mod_hash(jnp.asarray(windows), table.shape[0]))
  assert idx_np.dtype == np.int32 and (idx_np == idx_jnp).all()
  on_device = jax.jit(ngram_mod_lookup)(jnp.asarray(table), jnp.asarray(windows))
  assert (ngram_mod_lookup(table, windows) == np.asarray(on_device)).all()
  # llama.cpp's 64-bit hash reduces to the same index for power-of-two sizes
  w = [int(t) for t in windows[0]]
  h64 = 0
  for t in w:
    h64 = (h64 * 6364136223846793005 + t) % 2 ** 64
  assert h64 % table.shape[0] == idx_np[0]


def test_mod_drafts_rolling_lookup_and_n_min():
  d = NgramMod(n_match=2, n_min=2, n_max=5, table_size=1 << 12, add_chunk=0)
  assert NgramMod().table.shape == (4 * 1024 * 1024,) and NgramMod().max_draft == 64
  h = [1, 2, 3, 4, 5, 6, 1, 2]
  d.begin([h])
  assert draft_of(d, h) == [3, 4, 5, 6, 1]                    # chained lookups up to n_max
  draft = draft_of(d, h)
  key = np.asarray(h[-2:] + draft, np.int32)                  # the same through the pure lookup
  windows = np.lib.stride_tricks.sliding_window_view(key[:-1], 2)
  assert ngram_mod_lookup(d.table, windows).tolist() == draft
  d2 = NgramMod(n_match=2, n_min=3, n_max=5, table_size=1 << 12, add_chunk=0)
  d2.begin([[1, 2, 3]])                                       # only (1, 2) -> 3 is known
  d2.begin([[7, 1, 2]])
  assert draft_of(d2, [7, 1, 2]) == []                        # 1 token < n_min
  assert draft_of(d2, [7, 1, 2], n_max=1) == [3]              # a budget below n_min is enough


def test_mod_table_persists_and_resets_on_low_acceptance():
  d = NgramMod(n_match=2, n_min=1, n_max=4, table_size=1 << 12, add_chunk=0)
  d.begin([[1, 2, 3, 4]])
  d.begin([[8, 1, 2]])                                        # another request: the table persists
  assert draft_of(d, [8, 1, 2]) == [3, 4]
  for i in range(2):
    d.accept(np.array([0]))
    assert draft_of(d, [8, 1, 2]) == [3, 4]
  d.accept(np.array([0]), verified=np.array([False]))        # not verified: streak unchanged
  assert draft_of(d, [8, 1, 2]) == [3, 4]
  d.accept(np.array([1]))                                     # 1/2 is not < 50%: streak broken
  for i in range(3):
    assert draft_of(d, [8, 1, 2]) == [3, 4]
    d.accept(np.array([0]))
  assert d.n_resets == 1 and d.n_overwritten == 0 and (d.table == EMPTY).all()
  assert draft_of(d, [8, 1, 2]) == []                         # only its own history is added back


def test_mod_resets_when_a_quarter_is_overwritten():
  d = NgramMod(n_match=1, n_min=1, n_max=2, table_size=16, add_chunk=0)
  d.begin([list(range(40))])                                 # 39 adds into 16 entries
  assert d.n_overwritten > 4 and d.n_resets == 0
  d.begin([[1, 2]])                                           # checked before adding the new prompt
  assert d.n_resets == 1 and d.n_overwritten == 0
  assert draft_of(d, [1, 2]) == [] and draft_of(d, [1, 2, 1]) == [2, 1]


# ------------------------------------------------------------------------------------------------
# ngram_cache


def test_cache_context_drafting_and_thresholds():
  d = NgramCache(n_draft=4)
  assert NgramCache().max_draft == 8
  h = [1, 2, 3, 1, 2, 3, 1, 2]
  d.begin([h])
  assert draft_of(d, h) == [3, 1, 2, 3]
  assert draft_of(d, h, n_max=2) == [3, 1]
  d.begin([[1, 2, 3, 4, 1, 2]])                               # 2-gram seen once: lax needs 2 samples
  assert draft_of(d, [1, 2, 3, 4, 1, 2]) == []
  h = [9, 1, 2, 3, 4, 9, 1, 2]                                # 3-gram seen once: 1 sample is enough
  d.begin([h])
  assert draft_of(d, h) == [3, 4, 9, 1]
  d.begin([[5, 6, 5]])
  assert draft_of(d, [5, 6, 5]) == []                       # 1-gram "5" seen once: needs 2 samples


def test_cache_static_and_dynamic_files(tmp_path):
  corpus = [[1, 2, 3, 1, 2, 3], [1, 2, 3, 9]]
  path = tmp_path / "static.bin"
  static = build_static_cache(corpus, path)
  assert static == {(1, 2): {3: 3}, (2, 3): {1: 1, 9: 1}, (3, 1): {2: 1}}
  assert load_ngram_cache(path) == static
  raw = np.fromfile(path, dtype="<i4").tolist()
  assert raw[:7] == [1, 2, EMPTY, EMPTY, 1, 3, 3]           # llama.cpp's record layout
  class Tok:
    def encode(self, text):
      return [ord(c) - 96 for c in text]
  assert build_static_cache(["abcabc", "abci"], tokenizer=Tok()) == static
  with pytest.raises(ValueError):
    build_static_cache(["abc"])
  d = NgramCache(n_draft=3, static=path)
  d.begin([[7, 1, 2]])
  assert draft_of(d, [7, 1, 2]) == [3, 1]                    # static 2-grams; (2, 3): 1 of 2 is 50%, enough
  dyn = update_ngram_counts({}, [4, 5, 6] * 3, 9)
  save_ngram_cache(dyn, tmp_path / "dyn.bin")
  d = NgramCache(n_draft=3, dynamic=tmp_path / "dyn.bin")
  d.begin([[4, 5]])
  assert draft_of(d, [4, 5]) == [6, 4, 5]                    # strict thresholds met (3 samples, 100%)


def test_cache_context_is_per_request_and_dynamic_opt_in(tmp_path):
  h1 = [1, 2, 3, 1, 2, 3, 1, 2]
  d = NgramCache(n_draft=2)
  d.begin([h1])
  assert draft_of(d, h1) == [3, 1]
  d.begin([[1, 2]])
  assert draft_of(d, [1, 2]) == []                           # no leak from the previous request
  d = NgramCache(n_draft=2, update_dynamic=True)
  d.begin([h1 * 3])
  d.begin([[1, 2]])                                           # the previous context joined the dynamic cache
  assert draft_of(d, [1, 2]) == [3, 1]
  d.save_dynamic(tmp_path / "dyn.bin")
  assert load_ngram_cache(tmp_path / "dyn.bin") == d.dynamic


# ------------------------------------------------------------------------------------------------
# Through the engine

CFG = ModelConfig(arch="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
PROMPTS = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 8],
           [10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10]]
OTHER = [[20, 21, 22, 20, 21, 22, 20], [30, 31, 30, 31, 30, 31, 30, 31, 30], [40, 41, 42, 43, 40, 41]]
MAX_NEW = 40

DRAFTERS = {   # small keys and K = 8 for all, so the engine compiles once per batch size
    "ngram_simple": lambda: NgramSimple(size_n=2, size_m=8),
    "ngram_map_k": lambda: NgramMapK(size_n=2, size_m=8),
    "ngram_map_k4v": lambda: NgramMapK4V(size_n=2, size_m=8),
    "ngram_mod": lambda: NgramMod(n_match=3, n_min=1, n_max=8, table_size=1 << 12, add_chunk=0),
    "ngram_cache": lambda: NgramCache(n_draft=8),
}


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, 0)


@pytest.fixture(scope="module")
def reference(params):
  return {b: generate_plain(params, CFG, PROMPTS[-b:], max_new_tokens=MAX_NEW).tokens for b in (1, 3)}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_lossless_through_engine(name, params, reference):
  for b in (1, 3):
    res = speculative_generate(params, CFG, PROMPTS[-b:], DRAFTERS[name](), max_new_tokens=MAX_NEW)
    assert res.tokens == reference[b], (name, b)
    assert res.stats.name == name
    if name == "ngram_simple":
      assert res.stats.acc_tokens > 0


def stats_of(res):
  s = dataclasses.asdict(res.stats)
  return {k: v for k, v in s.items() if k not in ("seconds", "draft_seconds")}


@pytest.mark.parametrize("name", ["ngram_simple", "ngram_map_k", "ngram_map_k4v", "ngram_cache"])
def test_requests_are_isolated(name, params):
  shared = DRAFTERS[name]()
  speculative_generate(params, CFG, OTHER, shared, max_new_tokens=MAX_NEW)
  after = speculative_generate(params, CFG, PROMPTS, shared, max_new_tokens=MAX_NEW)
  alone = speculative_generate(params, CFG, PROMPTS, DRAFTERS[name](), max_new_tokens=MAX_NEW)
  assert after.tokens == alone.tokens
  assert stats_of(after) == stats_of(alone)
