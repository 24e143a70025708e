"""Tests of the host chain (specjax/drafters/chain.py): policies, statistics and accept forwarding
with scripted drafters, then greedy losslessness and isolation through the engine."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from specjax.engine.decode import generate_plain
from specjax.drafters.base import DeviceDrafter, HostDrafter
from specjax.drafters.chain import Chain
from specjax.drafters.ngram_cache import NgramCache
from specjax.drafters.ngram_map import NgramMapK, NgramMapK4V
from specjax.drafters.ngram_mod import NgramMod
from specjax.drafters.ngram_simple import NgramSimple
from specjax.drafters.suffix import SuffixDecoding
from specjax.engine import speculative_generate
from specjax.models.config import ModelConfig
from specjax.models.decoder import init_params


class Scripted(HostDrafter):
  """Proposes fixed drafts (one list per sequence) and records what it is told."""

  def __init__(self, name, drafts, score=None, max_draft=4):
    self.name, self.drafts, self.score, self.max_draft = name, drafts, score, max_draft
    self.accepted, self.begun = [], 0

  def begin(self, prompts):
    self.begun += 1

  def propose(self, histories, n_max):
    tok = np.zeros((len(histories), self.max_draft), np.int32)
    ln = np.zeros((len(histories),), np.int32)
    for i, d in enumerate(self.drafts):
      d = d[:int(n_max[i])]
      tok[i, :len(d)], ln[i] = d, len(d)
    return tok, ln, None if self.score is None else np.asarray(self.score, np.float32)

  def accept(self, n_accepted, verified=None):
    self.accepted.append((np.asarray(n_accepted).tolist(), None if verified is None else np.asarray(verified).tolist()))


def test_first_policy_and_accept_forwarding():
  a = Scripted("a", [[], [1, 2], []])
  b = Scripted("b", [[5], [6, 7, 8], []], max_draft=3)
  c = Scripted("c", [[9], [9], [9]])
  chain = Chain([a, b, c], policy="first")
  assert chain.max_draft == 4 and chain.name == "chain_first(a,b,c)"
  chain.begin([[0], [0], [0]])
  assert a.begun == b.begun == c.begun == 1
  tok, ln, score = chain.propose([[0], [0], [0]], np.array([4, 4, 4]))
  assert tok.shape == (3, 4) and ln.tolist() == [1, 2, 1]
  assert tok.tolist() == [[5, 0, 0, 0], [1, 2, 0, 0], [9, 0, 0, 0]]
  assert chain.wins == {"a": 1, "b": 1, "c": 1}
  chain.accept(np.array([1, 2, 0]))
  assert a.accepted == [([0, 2, 0], [False, True, False])]
  assert b.accepted == [([1, 0, 0], [True, False, False])]
  assert c.accepted == [([0, 0, 0], [False, False, True])]    # its draft for sequence 2 was verified, 0 kept


def test_best_policy_uses_scores_then_statistics():
  long_ = Scripted("long", [[1, 2, 3], [1, 2, 3]])
  short = Scripted("short", [[4], [4]])
  scored = Scripted("scored", [[7, 7], []], score=[0.9, 0.0])
  chain = Chain([long_, short, scored], policy="best")
  chain.begin([[0], [0]])
  # prior 0.5 per position: E(3 tokens) = 0.875 < 0.9 (scored); E(1 token) = 0.5
  tok, ln, score = chain.propose([[0], [0]], np.array([4, 4]))
  assert tok[:, :3].tolist() == [[7, 7, 0], [1, 2, 3]]
  assert score.tolist() == pytest.approx([0.9, 0.875])
  assert chain.wins == {"long": 1, "short": 0, "scored": 1}
  chain.accept(np.array([0, 3]))                              # long: 3 of 3 accepted
  assert chain.tested[0][:3].tolist() == [1, 1, 1] and chain.accepted[0][:3].tolist() == [1, 1, 1]
  rates = (1 + 0.5 * 2) / (1 + 2)                             # 2/3 per position
  expect = rates + rates ** 2 + rates ** 3
  assert chain.expected_accepted(0, np.array([3]))[0] == pytest.approx(expect)
  tok, ln, score = chain.propose([[0], [0]], np.array([4, 4]))
  assert ln.tolist() == [3, 3] and score[0] == pytest.approx(expect)   # now beats the score 0.9
  chain.accept(np.array([0, 0]))                              # long rejected at position 0, twice
  assert chain.tested[0][:3].tolist() == [3, 1, 1] and chain.accepted[0][:3].tolist() == [1, 1, 1]
  chain.begin([[0], [0]])                                     # statistics are per request
  assert chain.wins == {"long": 0, "short": 0, "scored": 0} and chain.tested[0].sum() == 0


def test_best_policy_ties_and_budgets():
  a = Scripted("x", [[1, 2]])
  b = Scripted("x", [[3, 4]])
  chain = Chain([a, b], policy="best")
  assert chain.names == ("x", "x#2")
  chain.begin([[0]])
  tok, ln, _ = chain.propose([[0]], np.array([1]))            # budget 1 for both; tie -> the first
  assert tok[0, :ln[0]].tolist() == [1] and chain.wins == {"x": 1, "x#2": 0}
  tok, ln, _ = chain.propose([[0]], np.array([0]))            # a done sequence: nobody wins
  assert ln[0] == 0 and chain.wins == {"x": 1, "x#2": 0}


def test_chain_errors():
  with pytest.raises(ValueError):
    Chain([])
  with pytest.raises(ValueError):
    Chain([Scripted("a", [[1]])], policy="longest")
  class OnDevice(DeviceDrafter):
    name, max_draft = "dev", 1
  with pytest.raises(ValueError, match="host drafters only"):
    Chain([OnDevice()])
  duck = types.SimpleNamespace(name="duck", max_draft=1, on_device=False)     # not a HostDrafter
  with pytest.raises(ValueError, match="host drafters only"):
    Chain([duck])


# ------------------------------------------------------------------------------------------------
# Through the engine

CFG = ModelConfig(arch="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
PROMPTS = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 8],
           [10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10]]
OTHER = [[20, 21, 22, 20, 21, 22, 20], [30, 31, 30, 31, 30, 31, 30, 31, 30], [40, 41, 42, 43, 40, 41]]
MAX_NEW = 40


def drafters(per_request_only=False):
  """Every host speculator with K <= 8 (the chain's K is 8, as in the other test files)."""
  ds = [NgramSimple(size_n=3, size_m=8), NgramMapK(size_n=2, size_m=6), NgramMapK4V(size_n=2, size_m=8),
        NgramCache(n_draft=4), SuffixDecoding(max_depth=16, max_spec_tokens=8, max_cached_requests=0)]
  if not per_request_only:
    ds.insert(3, NgramMod(n_match=3, n_min=2, n_max=8, table_size=1 << 12, add_chunk=0))
  return ds


@pytest.fixture(scope="module")
def params():
  return init_params(CFG, 0)


@pytest.fixture(scope="module")
def reference(params):
  return {b: generate_plain(params, CFG, PROMPTS[-b:], max_new_tokens=MAX_NEW).tokens for b in (1, 3)}


def stats_of(res):
  s = dataclasses.asdict(res.stats)
  return {k: v for k, v in s.items() if k not in ("seconds", "draft_seconds")}


@pytest.mark.parametrize("policy", ["first", "best"])
def test_greedy_lossless_through_engine(policy, params, reference):
  for b in (1, 3):
    chain = Chain(drafters(), policy=policy)
    assert chain.max_draft == 8
    res = speculative_generate(params, CFG, PROMPTS[-b:], chain, max_new_tokens=MAX_NEW)
    assert res.tokens == reference[b], (policy, b)
    assert res.stats.acc_tokens > 0
    assert sum(chain.wins.values()) == res.stats.gen_drafts        # one verified draft per win


@pytest.mark.parametrize("policy", ["first", "best"])
def test_requests_are_isolated(policy, params):
  shared = Chain(drafters(per_request_only=True), policy=policy)
  speculative_generate(params, CFG, OTHER, shared, max_new_tokens=MAX_NEW)
  after = speculative_generate(params, CFG, PROMPTS, shared, max_new_tokens=MAX_NEW)
  wins_after = dict(shared.wins)
  alone_chain = Chain(drafters(per_request_only=True), policy=policy)
  alone = speculative_generate(params, CFG, PROMPTS, alone_chain, max_new_tokens=MAX_NEW)
  assert after.tokens == alone.tokens
  assert stats_of(after) == stats_of(alone)
  assert wins_after == alone_chain.wins
