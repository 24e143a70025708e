"""`specjax train eval-mtp` and `eval-eagle3` measure through the bench harness
(`specjax.train.head_eval`): on a toy prompt set with a tiny target and random heads, greedy rows
equal plain decoding (float32), tau lies in [1, n_max + 1], acceptance by position comes from whole
batches of several prompts, tau is given by category, and each command keeps its result format."""

from __future__ import annotations

import json

import pytest

from conftest import ToyTokenizer
from specjax.models.load import LoadedModel


@pytest.fixture()
def toy(tiny_llama, tmp_path):
  cfg, params = tiny_llama
  target = LoadedModel(name="tiny", cfg=cfg, params=params, tokenizer=ToyTokenizer(), source="tiny-llama")
  prompts = tmp_path / "toy.jsonl"
  prompts.write_text("".join(json.dumps({"question_id": i, "category": "ab"[i % 2], "turns": ["abcdefgh"[:i + 3]]})
                             + "\n" for i in range(4)))
  return target, str(prompts)


def test_eval_mtp_rows_through_the_harness(toy):
  from specjax.drafters.mtp import init_heads
  from specjax.train.mtp import evaluate_head
  target, prompts = toy
  heads = init_heads(target.cfg, 2, seed=1)                          # a head in memory, not a file
  res = evaluate_head(target, heads, prompt_set=prompts, per_category=2, n_max=(2, 3), max_new_tokens=6,
                      batch_size=2, progress=False)
  assert res["questions"] == ["0", "1", "2", "3"] and res["head"] == "(in memory)" and res["plain_tokens_per_s"] > 0
  assert [r["n_max"] for r in res["results"]] == [2, 3]
  for r in res["results"]:
    assert r["equal_to_plain"] == 1.0 and 1.0 <= r["tau"] <= r["n_max"] + 1
    assert len(r["acceptance_by_pos"]) == r["n_max"] and all(0.0 <= a <= 1.0 for a in r["acceptance_by_pos"])
    assert set(r["tau_by_category"]) == {"a", "b"} and r["speedup"] > 0


def test_eval_eagle3_chains_and_tree_through_the_harness(toy, tmp_path):
  import numpy as np

  from specjax.drafters.eagle3 import Eagle3Config, build_d2t, init_head, save_head
  from specjax.train.eagle3_eval import evaluate_eagle3
  target, prompts = toy
  v = target.cfg.vocab_size
  hc = Eagle3Config.make(target.cfg, 12)
  d2t = build_d2t([np.repeat(np.arange(v), np.arange(v, 0, -1))], v, 12)
  head, _ = save_head(tmp_path / "e3", init_head(hc, 7, target_params=target.params, d2t=d2t), d2t, hc,
                      dtype="float32")
  seen = []
  res = evaluate_eagle3(target, str(head), prompt_set=prompts, n_questions=4, n_max=(1, 2),
                        tree={"depth": 2, "top_k": 2, "budget": 4}, temperatures=(0.0,), max_new_tokens=6,
                        batch_size=4, progress=False, on_result=lambda r: seen.append(len(r["results"])))
  assert [(r["kind"], r.get("n_max"), r["verify_width"]) for r in res["results"]] == [
      ("chain", 1, 2), ("chain", 2, 3), ("tree", None, 5)]
  assert seen == [1, 2, 3] and [p["temperature"] for p in res["plain"]] == [0.0]
  tree = res["results"][-1]
  assert (tree["depth"], tree["top_k"], tree["budget"]) == (2, 2, 4)
  for r in res["results"]:
    assert r["equal_to_plain"] == 1.0 and 1.0 <= r["tau"] and r["tokens"] == res["plain"][0]["tokens"]
    assert r["drafted_by_pos"] and r["drafted_by_pos"][0] > 0
