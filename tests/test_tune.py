"""spec-tune: strict tune configs, a seeded search space, the tune/held-out split, successive halving,
and end-to-end runs on a tiny random model (the best trial is the best measured one, the budget holds,
`best.yaml` is a valid bench config)."""

from __future__ import annotations

import dataclasses
import json
import math

from pathlib import Path

import pytest

from specjax.bench.config import ConfigError, MethodConfig, load_config
from specjax.bench.prompts import Question, load_prompt_set
from specjax import tune

TINY_DEFAULT = {"name": "default", "speculator": "ngram_simple",
                "options": {"size_n": 3, "size_m": 8, "device": False}, "draft_params": {"n_max": 4}}
# Every configuration of this space drafts at most 8 tokens, so the verify step compiles once per
# power-of-two width (1, 2, 4, 8) and trials after the first few compile nothing.
TINY_SPACE = {
    "speculators": {"ngram_simple": {"size_n": [1, 2, 3], "size_m": 8, "device": False},
                    "ngram_map_k": {"size_n": [1, 2, 3], "size_m": 8},
                    "suffix": {"max_spec_tokens": 8, "min_token_prob": [0.05, 0.2]}},
    "chains": {"members": ["ngram_simple", "suffix"], "max_len": 2, "policies": ["best", "first"]},
    "draft_params": {"n_max": [2, 4, 8], "n_min": [0, 1]},
}
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tune_smollm2_mt_bench.yaml"
WORDS = ["cat", "dog", "sun", "sea", "fox", "owl", "car", "map", "hat", "cup"]


def tiny_config(**tune_kw) -> tune.TuneConfig:
  return tune.tune_config_from_dict({
      "name": "tiny_tune", "target": "tiny-random", "max_new_tokens": 48, "turns": 1,
      "methods": [TINY_DEFAULT], "tune": {**TINY_SPACE, **tune_kw}})


def tiny_questions(n: int = 8) -> list[Question]:
  # one prompt width bucket (< 64 byte tokens with the chat wrapper): one prefill compilation
  return [Question(str(i), "ab"[i % 2], (f"Say {w} {w} {w} now.",)) for i, w in enumerate(WORDS[:n])]


@pytest.fixture(scope="module")
def target():
  return tune.tiny_target()


# ------------------------------------------------------------------------------------------------
# configs and the space (no model)


def test_committed_config_loads():
  t = tune.load_tune_config(CONFIG)
  assert t.default_method.name == "default"
  assert t.tune.strategy in tune.STRATEGIES and t.tune.budget.trials
  t2 = tune.load_tune_config(CONFIG, trials=3, seconds=10.0, seed=7, limit=4,
                             strategy="random")
  assert (t2.tune.budget.trials, t2.tune.budget.seconds, t2.tune.seed, t2.experiment.limit,
          t2.tune.strategy) == (3, 10.0, 7, 4, "random")


@pytest.mark.parametrize("patch, key", [
    ({"tune": {"bogus": 1}}, "bogus"),
    ({"tune": {"strategy": "grid"}}, "strategy"),
    ({"tune": {"speculators": {"ngram_simple": {"sizen": [1]}}}}, "sizen"),
    ({"tune": {"speculators": {"nope": {}}}}, "nope"),
    ({"tune": {"chains": {"members": ["draft", "suffix"]}}}, "chains.members"),
    ({"tune": {"draft_params": {"n_max": [0, 4]}}}, "n_max"),
    ({"tune": {"budget": {"trials": None, "seconds": None}}}, "budget"),
    ({"tune": {"budget": {"trials": None, "seconds": 5.0}, "strategy": "halving"}}, "halving"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"tune": {"arm_weights": {"suffix": 1}}}, "arm_weights"),
    ({"tune": {"speculators": {"eagle3": {"draft_params": {"n_max": [2]}}}}}, "eagle3: needs head"),
    ({"tune": {"speculators": {"ngram_simple": {"head": ["h.safetensors"]}}}}, "head"),
    ({"tune": {"speculators": {"eagle3_tree": {"head": ["h"], "adaptive": [True]}}}}, "adaptive"),
    ({"tune": {"speculators": {"ngram_simple": {"adaptive": ["yes"]}}}}, "adaptive"),
])
def test_config_errors_name_the_key(patch, key):
  data = {"name": "x", "tune": {}}
  for k, v in patch.items():
    data[k] = {**data[k], **v} if isinstance(v, dict) and isinstance(data.get(k), dict) else v
  with pytest.raises(ConfigError, match=key):
    tune.tune_config_from_dict(data)


def test_config_needs_a_tune_section():
  with pytest.raises(ConfigError, match="tune"):
    tune.tune_config_from_dict({"name": "x"})
  with pytest.raises(ConfigError, match="tune"):
    tune.load_tune_config(CONFIG.parent / "bench_smoke_smollm2.yaml")        # a bench config is no tune config


def test_candidates_are_seeded_distinct_and_capped():
  t = tiny_config(seed=3).tune
  default = MethodConfig(**{**TINY_DEFAULT, "draft_params": tune.DraftParamsConfig(n_max=4)})
  a = tune.sample_candidates(t, 15, default)
  b = tune.sample_candidates(t, 15, default)
  c = tune.sample_candidates(dataclasses.replace(t, seed=4), 15, default)
  assert [tune.method_key(m) for m in a] == [tune.method_key(m) for m in b]          # same seed, same list
  assert [tune.method_key(m) for m in a] != [tune.method_key(m) for m in c]
  assert tune.method_key(a[0]) == tune.method_key(default)                            # trial 0 is the default
  assert len({tune.method_key(m) for m in a}) == len(a)                               # no duplicates
  for m in a:
    dp = m.draft_params
    assert 1 <= dp.n_max <= tune._max_draft(m) and 0 <= dp.n_min <= dp.n_max
  assert any("," in m.speculator for m in a)                                          # chains are drawn
  # arm weights: a zero weight is never drawn, the others are
  weighted = dataclasses.replace(t, arm_weights={"ngram_simple": 0, "chain": 3})
  specs = [m.speculator for m in tune.sample_candidates(weighted, 12)]
  assert "ngram_simple" not in specs and any("," in s for s in specs)
  # an exhausted space ends the stream instead of looping
  small = dataclasses.replace(t, speculators={"ngram_cache": {"n_draft": 4}}, chains=tune.ChainSpace(),
                              draft_params={"n_max": [2, 4], "n_min": [0]})
  assert len(tune.sample_candidates(small, 10)) == 2


def test_adaptive_drafting_is_a_searched_dimension():
  """`adaptive: [false, true]` in a speculator's space draws methods with adaptive drafting on and
  off (a MethodConfig the bench runs as such); without it every method is fixed."""
  t = tiny_config(seed=5, speculators={"ngram_simple": {"size_n": [1, 2], "adaptive": [False, True]}},
                  chains={"members": []}).tune
  drawn = tune.sample_candidates(t, 8)
  assert {m.adaptive for m in drawn} == {False, True}
  assert all(tune.method_label(m).endswith(" adaptive") == m.adaptive for m in drawn)
  assert not any(m.adaptive for m in tune.sample_candidates(tiny_config(seed=5).tune, 8))


def test_a_trees_node_budget_is_a_searched_option():
  """A tree speculator's node budget is its `n_nodes` option, searched like any option (n_max stays
  the draft-parameter dimension: the tree's depth cap); a bad value names the option."""
  t = tiny_config(seed=2, speculators={"eagle3_tree": {"head": ["h.safetensors"], "n_nodes": [16, 48],
                                                       "depth": [6]}}, chains={"members": []}).tune
  drawn = tune.sample_candidates(t, 6)
  assert {m.options["n_nodes"] for m in drawn} == {16, 48} and all(m.speculator == "eagle3_tree" for m in drawn)
  assert all("n_nodes=" in tune.method_label(m) for m in drawn)
  with pytest.raises(ConfigError, match=r"unknown option 'nodes'.*n_nodes"):
    tune.tune_config_from_dict({"name": "x", "tune": {"speculators": {"eagle3_tree": {"head": ["h"],
                                                                                      "nodes": [16]}}}})


def test_split_is_stratified_disjoint_and_seeded(prompt_data):
  qs = load_prompt_set("mt_bench", limit=40)      # tests/conftest.py's tiny set: 8 categories x 5
  tune_qs, hold = tune.split_questions(qs, 0.5, seed=0)
  ids_t, ids_h = {q.question_id for q in tune_qs}, {q.question_id for q in hold}
  assert not ids_t & ids_h and len(ids_t | ids_h) == 40
  cats = {q.category for q in qs}
  assert {q.category for q in hold} == cats and {q.category for q in tune_qs} == cats
  assert len({q.category for q in tune_qs[:len(cats)]}) == len(cats)                 # prefixes interleave
  assert [q.question_id for q in tune.split_questions(qs, 0.5, seed=0)[1]] == [q.question_id for q in hold]
  assert [q.question_id for q in tune.split_questions(qs, 0.5, seed=1)[1]] != [q.question_id for q in hold]


def test_halving_schedule():
  assert tune.halving_schedule(20, 24, 2, 2) == [2, 5, 10, 20]
  assert tune.halving_schedule(20, 24, 2, 1) == [1, 2, 5, 10, 20]
  assert tune.halving_schedule(4, 1, 2) == [4]
  assert tune.halving_schedule(27, 9, 3) == [3, 9, 27]
  assert tune.halving_schedule(3, 100, 2, 2) == [3]


# ------------------------------------------------------------------------------------------------
# end to end on the tiny random model


def _check_best(report):
  trials = [r for r in report["trials"] if r["status"] == "ok"]
  most = max(r["n_questions"] for r in trials)
  top = [r for r in trials if r["n_questions"] == most]
  best = report["trials"][report["best"]]
  assert best["n_questions"] == most
  assert best["metric"] == max(r["metric"] for r in top)
  assert best["metric"] == best[report["metric"]]
  assert report["best_method"]["speculator"] == best["method"]["speculator"]
  assert report["best_method"]["draft_params"] == best["method"]["draft_params"]


@pytest.fixture(scope="module")
def halving_run(target, tmp_path_factory):
  tcfg = tiny_config(seed=0, strategy="halving", budget={"trials": 6}, min_questions=1)
  report = tune.run_tune(tcfg, target=target, questions=tiny_questions(8), progress=False)
  out = tmp_path_factory.mktemp("tune")
  return report, tune.write_outputs(report, out)


def test_halving_run_picks_the_best_measured_trial(halving_run):
  report, _ = halving_run
  assert len(report["trials"]) <= 6 and report["stop_reason"] == "trials"
  assert report["trials"][0]["label"] == report["default"]["label"]
  assert report["rungs"] == [1, 2, 4]
  _check_best(report)
  ok = [r for r in report["trials"] if r["status"] == "ok"]
  assert all(r["rungs"][0]["n_questions"] == 1 for r in ok)                        # everyone starts small
  assert len([r for r in ok if r["n_questions"] == 4]) == math.ceil(math.ceil(len(ok) / 2) / 2)
  assert not set(report["tune_questions"]) & set(report["holdout_questions"])
  hs = report["holdout"]["summary"]
  assert set(hs) == {"plain", "default", "tuned"}
  assert all(s["overall"]["prompts"] == len(report["holdout_questions"]) for s in hs.values())
  assert all(s["overall"]["equal"] == 1.0 for s in hs.values())                     # greedy is lossless


def test_outputs_are_valid(halving_run):
  report, paths = halving_run
  cfg = load_config(paths["best"])                                                  # strict bench config
  assert [m.name for m in cfg.methods] == ["default", "tuned"]
  assert tune.method_key(cfg.methods[1]) == tune.method_key(MethodConfig(**{
      **report["best_method"], "draft_params": tune.DraftParamsConfig(**report["best_method"]["draft_params"])}))
  held = load_prompt_set(cfg.prompts[0])
  assert [q.question_id for q in held] == report["holdout_questions"]
  data = json.loads(paths["trials"].read_text())
  assert data["best"] == report["best"] and len(data["trials"]) == len(report["trials"])
  held_out = json.loads(paths["holdout"].read_text())
  for result in (data, held_out):                                                   # provenance of both files
    assert set(result["environment"]) == {"xla_flags", "specjax_env", "versions", "cuda"}
    assert result["files"] == {"target": []}                                        # the random model has none
  assert all(s["overall"]["repeat_spread"]["n"] == 1 for s in held_out["summary"].values())
  assert json.loads(paths["holdout"].read_text())["summary"].keys() == report["holdout"]["summary"].keys()
  assert paths["trials_png"].stat().st_size > 10_000 and paths["holdout_png"].stat().st_size > 10_000
  md = paths["trials_md"].read_text()
  assert f"**best: trial {report['best']}**" in md and md.count("\n| ") >= len(report["trials"]) + 4


def test_random_run_respects_the_seconds_budget(target, halving_run):
  # compiled programs are warm from the halving run: a trial costs well under a second
  budget = 4.0
  tcfg = tiny_config(seed=1, strategy="random", budget={"trials": None, "seconds": budget})
  report = tune.run_tune(tcfg, target=target, questions=tiny_questions(6), progress=False)
  assert report["stop_reason"] in ("seconds", "space exhausted")
  longest_call = max((r["wall_seconds"] for r in report["trials"]), default=0.0)
  assert report["search_seconds"] <= budget + longest_call + 1.0
  _check_best(report)
  assert all(r["n_questions"] == len(report["tune_questions"]) for r in report["trials"] if r["status"] == "ok")


def test_random_run_respects_the_trial_budget(target, halving_run):
  tcfg = tiny_config(seed=2, strategy="random", budget={"trials": 3}, include_default=False)
  report = tune.run_tune(tcfg, target=target, questions=tiny_questions(4), progress=False)
  assert len(report["trials"]) == 3 and report["stop_reason"] == "trials"
  assert report["trials"][0]["label"] != report["default"]["label"]
  _check_best(report)


def test_repeats_of_a_suffix_trial_see_the_same_drafter(target, monkeypatch):
  """A trial times each question `repeats` times from one drafter state: the suffix drafter's global
  tree (cross-request memory) is restored before every timed repeat, so the second repeat cannot
  draft the answer the first one just produced; both repeats accept exactly what a one-repeat run
  accepts, and the warm-up leaves no trace either."""
  from specjax.bench.runner import Runner
  timed = []
  call = Runner._call

  def spy(self, prompts, max_new_tokens, warm=False):
    out = call(self, prompts, max_new_tokens, warm)
    if not warm and out.stats is not None:
      timed.append((self.cfg.repeats, out.stats.acc_tokens, out.stats.rounds))
    return out

  monkeypatch.setattr(Runner, "_call", spy)
  method = MethodConfig(name="suffix", speculator="suffix", options={"max_spec_tokens": 8},
                        draft_params=tune.DraftParamsConfig(n_max=8))
  questions = tiny_questions(3)
  counts = {}
  for repeats in (1, 2):
    cfg = dataclasses.replace(tiny_config().experiment, repeats=repeats)
    recs = tune.run_questions(cfg, target, method, questions)
    counts[repeats] = [(r.acc_tokens, r.rounds) for r in recs]
    assert all(len(r.repeat_seconds) == repeats for r in recs)
  assert counts[1] == counts[2] and sum(a for a, _ in counts[1]) > 0
  twice = [(a, n) for reps, a, n in timed if reps == 2]
  assert twice[0::2] == twice[1::2] == [(a, n) for reps, a, n in timed if reps == 1]
