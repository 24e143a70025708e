"""The benchmark harness: a tiny real config end to end, with the JSON's numbers checked against
what the engine returns for the same prompts; malformed configs fail naming the key (at load, before
any model; hypothesis draws random bad values of every field); a result carries its provenance
(environment, versions, file checksums) and the spread over repeats."""

from __future__ import annotations

import hashlib
import json
import math
import os

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

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
    # the bench-config rows of the user-error table: checked at load, before any model
    ({"prompts": [123]}, "prompts"),
    ({"methods": [{"name": "x", "speculator": "ngram_simple", "options": {"bogus_opt": 7}}]}, "options"),
    ({"limit": -1}, "limit"),
    ({"limit": 0}, "limit"),
    ({"sampling": {"temperature": float("nan")}}, "temperature"),
    ({"methods": [{"name": "plain", "speculator": "ngram_simple"}]}, "name"),
    ({"methods": [{"name": "a", "speculator": "suffix"}, {"name": "a", "speculator": "ngram_simple"}]}, "name"),
    ({"methods": [{"name": "a", "speculator": "ngram_simple", "adaptive": {"segmnt_rounds": 4}}]}, "adaptive"),
    ({"target": "no-such-model"}, "target"),
    ({"capacity": 8}, "capacity"),
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
  from specjax.serve.bench_config import load_bench_serve
  for path in sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("bench_*.yaml")):
    if path.name.startswith("bench_serve"):      # a bench config plus a serve: section (specjax bench-serve)
      load_bench_serve(path)
    else:
      load_config(path)                            # tune_* by tests/test_tune.py, train_* by test_train_spec_base.py


# every non-timing field of a per-prompt record: the same whatever the order methods ran in
ROW_FIELDS = ("question_id", "turn", "category", "new_tokens", "tokens_digest", "rounds", "gen_tokens", "acc_tokens",
              "emitted", "drafted_by_pos", "accepted_by_pos", "equal_to_plain")


@pytest.mark.real
def test_tiny_run_numbers_match_the_engine(tmp_path, prompt_data):
  """Run plain + ngram_simple on 2 MT-bench questions x 2 turns, method after method and batch by
  batch (interleave): both orders record the same rows; every per-prompt record of each must equal
  what the engine returns for the same tokens, and each summary must be the aggregate of them.
  (One test for both orders: the engine's answers and the compiled programs serve both.)"""
  if not model_path("smollm2-135m-instruct").exists():
    pytest.skip("SmolLM2 not fetched")
  from specjax.bench.harness import run_experiment
  from specjax.bench.records import PLAIN
  from specjax.bench.runner import _messages
  from specjax.bench.prompts import load_prompt_set
  from specjax.engine.decode import generate_plain
  from specjax.drafters.base import DraftParams
  from specjax.drafters.ngram_device import NgramSimpleDevice
  from specjax.engine import speculative_generate
  from specjax.models.load import load_model

  results = {interleave: json.loads(json.dumps(run_experiment(config_from_dict({**TINY, "interleave": interleave}),
                                                              progress=False)))   # what lands in the file
             for interleave in (False, True)}
  rows = {il: {m: [{k: r[k] for k in ROW_FIELDS} for r in recs] for m, recs in res["prompts"].items()}
          for il, res in results.items()}
  assert rows[True] == rows[False]

  target = load_model("smollm2-135m-instruct", progress=False)
  tok = target.tokenizer
  questions = load_prompt_set("mt_bench", limit=2)
  engine = {}                                # (method, question, turn) -> (tokens, stats or None)

  def answer(name, q, turn):
    """The engine's tokens for `q`'s turn after its own earlier answers (memoised)."""
    if (name, q.question_id, turn) not in engine:
      prev = [tok.decode(answer(name, q, t)[0]) for t in range(turn)]
      prompt = tok.encode_chat(_messages(q, prev, turn))
      if name == PLAIN:
        out = generate_plain(target.params, target.cfg, [prompt], max_new_tokens=12, stop_ids=tok.eos_ids,
                             capacity=512)
        engine[name, q.question_id, turn] = (out.tokens[0], None)
      else:
        out = speculative_generate(target.params, target.cfg, [prompt], NgramSimpleDevice(2, 4, width=4),
                                   max_new_tokens=12, stop_ids=tok.eos_ids, capacity=512,
                                   draft_params=DraftParams(n_max=4))
        engine[name, q.question_id, turn] = (out.tokens[0], out.stats)
    return engine[name, q.question_id, turn]

  for result in results.values():
    recs = result["prompts"]
    assert len(recs[PLAIN]) == len(recs["ngram"]) == 4
    for rec_p, rec_s in zip(recs[PLAIN], recs["ngram"]):
      q = next(q for q in questions if q.question_id == rec_p["question_id"])
      for name, rec in ((PLAIN, rec_p), ("ngram", rec_s)):
        toks, st = answer(name, q, rec["turn"])
        if st is not None:
          assert (rec["rounds"], rec["acc_tokens"], rec["gen_tokens"], rec["emitted"]) == \
              (st.per_seq_rounds[0], st.per_seq_acc_tokens[0], st.per_seq_gen_tokens[0], st.per_seq_emitted[0])
          assert rec["drafted_by_pos"] == st.drafted_by_pos and rec["accepted_by_pos"] == st.accepted_by_pos
        assert rec["new_tokens"] == len(toks)
      assert rec_s["equal_to_plain"] == (tok.decode(answer(PLAIN, q, rec_p["turn"])[0]) ==
                                         tok.decode(answer("ngram", q, rec_s["turn"])[0]))

    s = result["summary"]["ngram"]["overall"]
    rounds = sum(r["rounds"] for r in recs["ngram"])
    assert s["tau"] == pytest.approx(sum(r["emitted"] for r in recs["ngram"]) / rounds)
    assert s["new_tokens"] == sum(r["new_tokens"] for r in recs["ngram"])
    ratios = [r["new_tokens"] / r["seconds"] / (p["new_tokens"] / p["seconds"]) for r, p in zip(recs["ngram"], recs[PLAIN])]
    assert s["speedup"] == pytest.approx(sum(ratios) / len(ratios))
    assert result["summary"][PLAIN]["overall"]["equal"] == 1.0
    assert set(result["summary"]["ngram"]["by_category"]) == {q.category for q in questions}
    assert result["git_revision"] and result["device"]["platform"] == "cpu"
    from specjax.io.fetch import MODELS
    (gguf,) = result["files"]["target"]                                # the checksum of the model file run
    assert gguf["path"] == str(model_path("smollm2-135m-instruct"))
    assert gguf["sha256"] == MODELS["smollm2-135m-instruct"].sha256


def test_adaptive_method_reports_what_its_controller_did(prompt_data):
  """A bench method with adaptive drafting on records, per batch, the widths its controller ran
  and their costs, and the replayed tokens per round by width; the rounds at each width add up to
  the rounds of its records (batch size 1: a batch's rounds are its prompt's). The round costs are
  given (rising with the width), so no width is pruned by a timing of this machine's load; measuring
  them is tests/test_adaptive.py's. On the tiny random model (byte tokenizer, chat-formatted
  MT-bench prompts), whose greedy answers loop, so the n-gram drafter has something to find."""
  from specjax.bench.harness import run_experiment
  cfg = config_from_dict({**TINY, "target": "tiny-random", "turns": 1, "batch_size": 1, "max_new_tokens": 24,
                          "capacity": 128, "methods": [
      {"name": "adaptive", "speculator": "ngram_simple", "options": {"size_n": 2, "size_m": 4},
       "draft_params": {"n_max": 4},
       "adaptive": {"segment_rounds": 4, "explore_rounds": 2, "costs": [1.0, 1.1, 1.2, 1.4]}}]})
  result = json.loads(json.dumps(run_experiment(cfg, progress=False)))
  s = result["summary"]["adaptive"]["overall"]
  ad = s["adaptive"]
  assert ad["widths"] == [0, 1, 2, 4] and len(ad["costs_ms"]) == 4 and all(c > 0 for c in ad["costs_ms"])
  assert ad["costs_ms"] == sorted(ad["costs_ms"])
  assert sum(ad["rounds_at_width"].values()) == sum(r["rounds"] for r in result["prompts"]["adaptive"])
  assert ad["first_batch_segments"][0][0] == 0   # device ngram_simple: replayed, nothing to explore first
  assert len(ad["replayed_tau"]) == 4 and ad["replayed_tau"][0] == pytest.approx(1.0)
  assert result["summary"]["adaptive"]["overall"]["equal"] == 1.0


# ------------------------------------------------------------------------------------------------
# random bad values of every config field: a ConfigError naming the key, never another exception

_INT32 = 2 ** 31 - 1


def _int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _num(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# field -> whether a value is valid there (TINY: max_new_tokens 12, capacity 512, n_max 4)
_VALID = {
    "name": lambda v: isinstance(v, str) and v.strip() != "" and "/" not in v and "\\" not in v,
    "dtype": lambda v: v in ("float32", "bfloat16", "float16"),
    "prompts": lambda v: isinstance(v, list) and v != [] and all(isinstance(x, str) and x.strip() for x in v),
    "limit": lambda v: v is None or (_int(v) and v >= 1),
    "categories": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "turns": lambda v: _int(v) and 1 <= v <= _INT32,
    "max_new_tokens": lambda v: _int(v) and 1 <= v and v + 4 + 2 <= 512,
    "batch_size": lambda v: _int(v) and 1 <= v <= _INT32,
    "repeats": lambda v: _int(v) and 1 <= v <= _INT32,
    "interleave": lambda v: isinstance(v, bool),
    "chat": lambda v: isinstance(v, bool),
    "seed": lambda v: _int(v) and 0 <= v < 2 ** 32,
    "capacity": lambda v: v is None or (_int(v) and 12 + 4 + 2 <= v <= _INT32),
    "sampling.temperature": lambda v: _num(v) and v >= 0,
    "sampling.top_k": lambda v: _int(v) and 0 <= v <= _INT32,
    "sampling.top_p": lambda v: _num(v) and 0 < v <= 1,
    "methods.name": lambda v: isinstance(v, str) and v.strip() != "" and v != "plain",
    "methods.policy": lambda v: v in ("best", "first"),
    "methods.options": lambda v: v == {},
    "methods.adaptive": lambda v: isinstance(v, bool) or v == {},
    "methods.draft_params.n_max": lambda v: _int(v) and 1 <= v and 12 + v + 2 <= 512,
    "methods.draft_params.n_min": lambda v: _int(v) and 0 <= v <= 4,
    "methods.draft_params.p_min": lambda v: _num(v) and 0 <= v <= 1,
}

_ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 40, 2 ** 40), st.sampled_from([0, 1, -1, 2 ** 31, 2 ** 32]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6), st.sampled_from(["float32", "best", ""]),
    st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=4), st.none()), max_size=3),
    st.dictionaries(st.text(min_size=1, max_size=6), st.one_of(st.integers(), st.text(max_size=3)), max_size=2))


def _patched(field: str, value) -> dict:
  data = json.loads(json.dumps(TINY))
  *path, key = field.split(".")
  node = data
  for p in path:
    node = node[p][0] if p == "methods" else node.setdefault(p, {})
  node[key] = value
  return data


@pytest.mark.parametrize("field", sorted(_VALID))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=_ANY)
def test_random_config_values_are_accepted_or_name_their_key(field, value):
  if field == "methods.options" and isinstance(value, dict):
    assume(not set(value) & {"size_n", "size_m", "device"})
  data = _patched(field, value)
  if _VALID[field](value):
    config_from_dict(data)
  else:
    with pytest.raises(ConfigError) as e:
      config_from_dict(data)
    msg = str(e.value)
    assert field.split(".")[-1] in msg and "\n" not in msg


# ------------------------------------------------------------------------------------------------
# the command line: one line, exit 2, before any model is loaded


@pytest.mark.parametrize("patch, key", [
    ({"prompts": [123]}, "prompts"),
    ({"methods": [{"name": "x", "speculator": "ngram_simple", "options": {"bogus_opt": 7}}]}, "bogus_opt"),
    ({"limit": -1}, "limit"),
    ({"prompts": ["/no/such/prompts.jsonl"]}, "/no/such/prompts.jsonl"),
])
def test_bench_cli_user_errors_are_one_line_before_loading(tmp_path, monkeypatch, capsys, patch, key):
  from specjax import cli
  from specjax.bench import harness

  def no_load(*a, **k):
    raise AssertionError("a model was loaded")
  monkeypatch.setattr(harness, "load_target", no_load)
  config = tmp_path / "bad.yaml"
  config.write_text(json.dumps({**TINY, **patch}))
  assert cli.main(["bench", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and key in err[0], err


def test_report_and_tune_cli_user_errors_exit_2(tmp_path, capsys):
  from specjax import cli
  from specjax.bench import tune_cli
  bad = tmp_path / "bad.json"
  bad.write_text("[1, 2]")
  assert cli.main(["report", str(bad)]) == 2
  assert cli.main(["report", str(tmp_path / "none.json")]) == 2
  assert tune_cli.main(["--config", str(tmp_path / "none.yaml")]) == 2
  tune = tmp_path / "tune.yaml"
  tune.write_text(json.dumps({**TINY, "limit": -1, "tune": {}}))
  assert tune_cli.main(["--config", str(tune)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 4 and all(line.startswith("error: ") for line in err), err
  assert "not a bench result" in err[0] and "no such result file" in err[1] and "no such config file" in err[2]
  assert "limit" in err[3]


# ------------------------------------------------------------------------------------------------
# provenance


def test_result_records_environment_files_and_spread_over_repeats(tmp_path, monkeypatch):
  """A bench result (tiny random model, 2 repeats) records XLA_FLAGS, every SPECJAX_* variable,
  library versions, CUDA (None on a CPU), the files read, and per method the min / median / max over
  repeats beside the figure used (each batch's fastest repeat: at least the fastest repeat's)."""
  from specjax.bench.harness import run_experiment
  monkeypatch.setenv("SPECJAX_BENCH_TEST_SWITCH", "on")
  prompts = tmp_path / "q.jsonl"
  prompts.write_text("".join(json.dumps({"question_id": f"q{i}", "category": "c", "turns": [f"Say {w} {w} {w}."]})
                             + "\n" for i, w in enumerate(["cat", "dog"])))
  cfg = config_from_dict({"name": "prov", "target": "tiny-random", "prompts": [str(prompts)], "turns": 1,
                          "max_new_tokens": 8, "capacity": 128, "repeats": 2,
                          "methods": [{"name": "ngram", "speculator": "ngram_simple", "draft_params": {"n_max": 4}}]})
  run_experiment(cfg, progress=False, out=tmp_path / "prov.json")
  r = json.loads((tmp_path / "prov.json").read_text())
  e = r["environment"]
  assert e["xla_flags"] == os.environ.get("XLA_FLAGS") and "xla_flags" in e
  assert e["specjax_env"]["SPECJAX_BENCH_TEST_SWITCH"] == "on"
  assert e["specjax_env"] == {k: v for k, v in os.environ.items() if k.startswith("SPECJAX_")}
  assert {"python", "jax", "jaxlib", "flax", "numpy"} <= set(e["versions"]) and all(e["versions"].values())
  assert e["cuda"] is None and r["device"]["platform"] == "cpu"
  assert r["files"] == {"target": []} and r["complete"] is True and r["git_revision"]
  for name in ("plain", "ngram"):
    o = r["summary"][name]["overall"]
    sp = o["repeat_spread"]
    assert sp["n"] == 2
    for k in ("seconds", "tokens_per_s"):
      assert sp[k]["min"] <= sp[k]["median"] <= sp[k]["max"]
    assert o["tokens_per_s"] >= sp["tokens_per_s"]["max"] * (1 - 1e-9)
    for row in r["prompts"][name]:
      assert len(row["repeat_seconds"]) == 2 and row["seconds"] == pytest.approx(min(row["repeat_seconds"]))
      assert len(row["tokens_digest"]) == 16


def test_file_checksums_trust_a_stamp_only_while_the_file_is_unchanged(tmp_path):
  from specjax.bench import env
  f = tmp_path / "m.gguf"
  f.write_bytes(b"weights" * 100)
  real = hashlib.sha256(f.read_bytes()).hexdigest()
  st_ = f.stat()
  stamp = tmp_path / "m.gguf.sha256"
  stamp.write_text(json.dumps({"sha256": "a" * 64, "size": st_.st_size, "mtime_ns": st_.st_mtime_ns}))
  assert env.model_files(str(f)) == [{"path": str(f), "bytes": 700, "sha256": "a" * 64}]   # the fetch's stamp
  f.write_bytes(b"weights" * 99)                                                              # truncated since
  assert env.model_files(str(f))[0]["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
  stamp.write_text(real)                                                                      # a bare stamp: hashed
  assert env.model_files(str(f))[0]["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
  assert env.model_files(None) == [] and env.head_files(tmp_path / "absent.safetensors") == []


def test_head_checksums_cover_the_config_and_every_shard(tmp_path):
  import numpy as np

  from specjax.bench import env
  from specjax.drafters.head_file import save_tensors
  weights = tmp_path / "head.safetensors"
  flat = {f"t{i}": np.full((64,), i, np.float32) for i in range(3)}
  written = save_tensors(flat, weights, {"kind": "test"}, max_bytes=300)
  (tmp_path / "head.json").write_text("{}")
  assert len(written) == 3
  files = env.head_files(weights)
  assert [f["path"] for f in files] == [str(weights), str(tmp_path / "head.json")] + [str(p) for p in written[1:]]
  assert all(f["sha256"] == hashlib.sha256(open(f["path"], "rb").read()).hexdigest() for f in files)
  assert env.head_files(tmp_path / "head.json") == files


def test_timed_calls_leave_what_the_process_holds_out_of_the_collector(tmp_path, monkeypatch):
  """Every timed generation call (not the warm-up) runs with the objects that existed before it
  frozen out of the cyclic collector's generations, so a collection inside it scans only what the
  call allocates; after the call they are back (nothing stays frozen between calls), and plain
  decoding and the speculator are timed alike."""
  import gc

  from specjax.bench.harness import run_experiment
  from specjax.bench.runner import Runner
  seen = []
  real = Runner._call

  def recorded(self, prompts, max_new_tokens, warm=False):
    seen.append((self.method.name if self.method else "plain", warm, gc.get_freeze_count()))
    return real(self, prompts, max_new_tokens, warm=warm)

  monkeypatch.setattr(Runner, "_call", recorded)
  prompts = tmp_path / "q.jsonl"
  prompts.write_text(json.dumps({"question_id": "q0", "category": "c", "turns": ["Say cat cat cat."]}) + "\n")
  cfg = config_from_dict({"name": "gc", "target": "tiny-random", "prompts": [str(prompts)], "turns": 1,
                          "max_new_tokens": 8, "capacity": 128, "repeats": 2,
                          "methods": [{"name": "ngram", "speculator": "ngram_simple", "draft_params": {"n_max": 4}}]})
  frozen_before = gc.get_freeze_count()
  run_experiment(cfg, progress=False)
  timed = [(name, n) for name, warm, n in seen if not warm]
  assert sorted({name for name, _ in timed}) == ["ngram", "plain"] and len(timed) == 4, seen
  assert all(n > frozen_before + 1000 for _, n in timed), seen          # the process's objects, frozen
  assert all(n == frozen_before for _, warm, n in seen if warm), seen  # the warm-up runs as it is
  assert gc.get_freeze_count() == frozen_before
