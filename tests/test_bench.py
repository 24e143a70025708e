"""The benchmark harness: a tiny real config end to end, with the JSON's numbers checked against
what the engine returns for the same prompts; malformed configs fail naming the key."""

from __future__ import annotations

import json

import pytest

from specjax.bench.config import ConfigError, config_from_dict, load_config
from specjax.io.fetch import model_path

TINY = {
    "name": "tiny", "target": "smollm2-135m-instruct", "dtype": "float32", "prompts": ["mt_bench"],
    "limit": 2, "turns": 2, "max_new_tokens": 12, "capacity": 512,
    "methods": [{"name": "ngram", "speculator": "ngram_simple", "options": {"size_n": 2, "size_m": 4},
                 "draft_params": {"n_max": 4}}],
}


@pytest.mark.parametrize("patch, key", [
    ({"methdos": []}, "methdos"),
    ({"max_new_tokens": "many"}, "max_new_tokens"),
    ({"methods": [{"name": "x", "speculator": "telepathy"}]}, "speculator"),
    ({"methods": [{"name": "x", "speculator": "draft"}]}, "draft_model"),
    ({"methods": [{"name": "x", "speculator": "ngram_simple", "draft_params": {"n_max": 2, "n_min": 3}}]}, "draft_params"),
    ({"sampling": {"temperature": -1.0}}, "temperature"),
    ({"sampling": {"temprature": 0.5}}, "temprature"),
])
def test_malformed_config_names_the_key(patch, key):
  with pytest.raises(ConfigError, match=key):
    config_from_dict({**TINY, **patch})


def test_yaml_errors_are_config_errors(tmp_path):
  bad = tmp_path / "bad.yaml"
  bad.write_text("name: [unclosed\n")
  with pytest.raises(ConfigError, match="not valid YAML"):
    load_config(bad)


def test_committed_bench_configs_parse():
  """Every experiment config under configs/ (not training / tuning configs) loads and validates."""
  from pathlib import Path
  import yaml
  for path in sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml")):
    data = yaml.safe_load(path.read_text())
    if "methods" in data and "tune" not in data:   # tune configs are checked by tests/test_tune.py
      load_config(path)


@pytest.mark.real
@pytest.mark.parametrize("interleave", [False, True])
def test_tiny_run_numbers_match_the_engine(tmp_path, interleave, prompt_data):
  """Run plain + ngram_simple on 2 MT-bench questions x 2 turns, method after method or batch by
  batch (interleave); every per-prompt record must equal what the engine returns for the same
  tokens, and the summary must be the aggregate of them."""
  if not model_path("smollm2-135m-instruct").exists():
    pytest.skip("SmolLM2 not fetched")
  from specjax.bench.harness import PLAIN, run_experiment, _messages
  from specjax.bench.prompts import load_prompt_set
  from specjax.decode import generate_plain
  from specjax.drafters.base import DraftParams
  from specjax.drafters.ngram_device import NgramSimpleDevice
  from specjax.engine import speculative_generate
  from specjax.models.load import load_model

  cfg = config_from_dict({**TINY, "interleave": interleave})
  result = json.loads(json.dumps(run_experiment(cfg, progress=False)))   # what lands in the file
  recs = result["prompts"]
  assert len(recs[PLAIN]) == len(recs["ngram"]) == 4

  target = load_model("smollm2-135m-instruct", progress=False)
  tok = target.tokenizer
  questions = load_prompt_set("mt_bench", limit=2)
  answers = {PLAIN: {}, "ngram": {}}
  for rec_p, rec_s in zip(recs[PLAIN], recs["ngram"]):
    q = next(q for q in questions if q.question_id == rec_p["question_id"])
    for name, rec in ((PLAIN, rec_p), ("ngram", rec_s)):
      prev = [answers[name][(q.question_id, t)] for t in range(rec["turn"])]
      prompt = tok.encode_chat(_messages(q, prev, rec["turn"]))
      if name == PLAIN:
        out = generate_plain(target.params, target.cfg, [prompt], max_new_tokens=12, stop_ids=tok.eos_ids,
                             capacity=512)
        toks = out.tokens[0]
      else:
        out = speculative_generate(target.params, target.cfg, [prompt], NgramSimpleDevice(2, 4, width=4),
                                   max_new_tokens=12, stop_ids=tok.eos_ids, capacity=512,
                                   draft_params=DraftParams(n_max=4))
        toks = out.tokens[0]
        st = out.stats
        assert (rec["rounds"], rec["acc_tokens"], rec["gen_tokens"], rec["emitted"]) == \
            (st.per_seq_rounds[0], st.per_seq_acc_tokens[0], st.per_seq_gen_tokens[0], st.per_seq_emitted[0])
        assert rec["drafted_by_pos"] == st.drafted_by_pos and rec["accepted_by_pos"] == st.accepted_by_pos
      assert rec["new_tokens"] == len(toks)
      answers[name][(q.question_id, rec["turn"])] = tok.decode(toks)
    assert rec_s["equal_to_plain"] == (answers[PLAIN][(q.question_id, rec_p["turn"])] ==
                                       answers["ngram"][(q.question_id, rec_s["turn"])])

  s = result["summary"]["ngram"]["overall"]
  rounds = sum(r["rounds"] for r in recs["ngram"])
  assert s["tau"] == pytest.approx(sum(r["emitted"] for r in recs["ngram"]) / rounds)
  assert s["new_tokens"] == sum(r["new_tokens"] for r in recs["ngram"])
  ratios = [r["new_tokens"] / r["seconds"] / (p["new_tokens"] / p["seconds"]) for r, p in zip(recs["ngram"], recs[PLAIN])]
  assert s["speedup"] == pytest.approx(sum(ratios) / len(ratios))
  assert result["summary"][PLAIN]["overall"]["equal"] == 1.0
  assert set(result["summary"]["ngram"]["by_category"]) == {q.category for q in questions}
  assert result["git_revision"] and result["device"]["platform"] == "cpu"


def test_adaptive_method_reports_what_its_controller_did(prompt_data):
  """A bench method with adaptive drafting on records, per batch, the widths its controller ran
  and their measured costs, and the replayed tokens per round by width; the rounds at each width add
  up to the rounds of its records (batch size 1: a batch's rounds are its prompt's)."""
  if not model_path("smollm2-135m-instruct").exists():
    pytest.skip("SmolLM2 not fetched")
  from specjax.bench.harness import run_experiment
  cfg = config_from_dict({**TINY, "turns": 1, "batch_size": 1, "max_new_tokens": 24, "methods": [
      {"name": "adaptive", "speculator": "ngram_simple", "options": {"size_n": 2, "size_m": 4},
       "draft_params": {"n_max": 4}, "adaptive": {"segment_rounds": 4, "explore_rounds": 2}}]})
  result = json.loads(json.dumps(run_experiment(cfg, progress=False)))
  s = result["summary"]["adaptive"]["overall"]
  ad = s["adaptive"]
  assert ad["widths"] == [0, 1, 2, 4] and len(ad["costs_ms"]) == 4 and all(c > 0 for c in ad["costs_ms"])
  assert ad["costs_ms"] == sorted(ad["costs_ms"])
  assert sum(ad["rounds_at_width"].values()) == sum(r["rounds"] for r in result["prompts"]["adaptive"])
  assert ad["first_batch_segments"][0][0] == 0   # device ngram_simple: replayed, nothing to explore first
  assert len(ad["replayed_tau"]) == 4 and ad["replayed_tau"][0] == pytest.approx(1.0)
  assert result["summary"]["adaptive"]["overall"]["equal"] == 1.0
