"""Nothing lost: a `specjax bench` run killed half-way (SIGKILL) keeps every completed row on disk
(its result JSON is valid and partial), and `--resume` completes it into the result an
uninterrupted run writes: the same rows with the same tokens and counts, the same summary apart
from timing. The kill lands inside the suffix method, so the resumed suffix rows also show that the
drafter's cross-request memory was rebuilt from the rows kept. `eval-dflash --resume` keeps the
temperatures an interrupted evaluation completed. On the tiny random model (~40 s and ~15 s on two
cores, most of it compiling)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [("a1", "x", ["cat?", "more."]), ("a2", "y", ["dog?", "more."]),
             ("a3", "x", ["sun?", "more."])]
# every non-timing field of a row: equal between a resumed and an uninterrupted run
ROW_FIELDS = ("category", "new_tokens", "tokens_digest", "rounds", "gen_tokens", "acc_tokens", "emitted",
              "drafted_by_pos", "accepted_by_pos", "equal_to_plain")
SUMMARY_FIELDS = ("prompts", "new_tokens", "tau", "acceptance_rate", "acceptance_by_pos", "equal")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("resume")
  prompts = tmp / "questions.jsonl"
  prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": t}) + "\n" for i, c, t in QUESTIONS))
  config = tmp / "tiny_resume.yaml"
  config.write_text(f"""name: tiny_resume
target: tiny-random
prompts: [{prompts}]
turns: 2
max_new_tokens: 16
capacity: 256
repeats: 2
methods:
  - {{name: suffix, speculator: suffix, options: {{max_spec_tokens: 4}}, draft_params: {{n_max: 4}}}}
  - {{name: ngram, speculator: ngram_simple, options: {{size_n: 2, size_m: 4}}, draft_params: {{n_max: 4}}}}
""")
  env = {**os.environ, "SPECJAX_COMPILE_CACHE": "1", "SPECJAX_COMPILE_CACHE_DIR": str(tmp / "jax_cache"),
         "PYTHONPATH": str(ROOT)}
  return tmp, config, env


def _bench(config, out, env, *extra):
  return [sys.executable, "-m", "specjax.cli", "bench", "--config", str(config), "--out", str(out), *extra]


def _rows(result: dict) -> dict:
  return {(m, r["question_id"], r["turn"]): {k: r[k] for k in ROW_FIELDS}
          for m, rows in result["prompts"].items() for r in rows}


def test_killed_bench_resumes_to_the_uninterrupted_result(setup):
  tmp, config, env = setup
  out = tmp / "killed"
  result, journal = out / "tiny_resume.json", out / "tiny_resume.rows.jsonl"
  n_rows = 3 * len(QUESTIONS) * 2            # plain, suffix, ngram x 3 questions x 2 turns

  # 1. kill the run (SIGKILL: no cleanup of any kind) once plain is done and suffix has begun
  proc = subprocess.Popen(_bench(config, out, env), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  t0 = time.monotonic()
  while proc.poll() is None and time.monotonic() - t0 < 120:
    if journal.exists() and len(journal.read_text().splitlines()) - 1 >= 2 * len(QUESTIONS) + 1:
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.02)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]
  lines = journal.read_text().splitlines()[1:]
  journaled = {(r["method"], r["question_id"], r["turn"]) for r in map(json.loads, lines)}
  kept = len(journaled)
  assert 2 * len(QUESTIONS) < kept < n_rows
  partial = json.loads(result.read_text())               # written atomically: always whole, behind the journal
  assert partial["complete"] is False and partial["prompts"]["plain"] and set(_rows(partial)) <= journaled

  # 2. resume it; 3. run it again uninterrupted
  resumed = subprocess.run(_bench(config, out, env, "--resume"), cwd=ROOT, env=env, capture_output=True, text=True)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  whole = subprocess.run(_bench(config, tmp / "whole", env), cwd=ROOT, env=env, capture_output=True, text=True)
  assert whole.returncode == 0, whole.stderr[-2000:]
  a, b = json.loads(result.read_text()), json.loads((tmp / "whole" / "tiny_resume.json").read_text())

  assert a["complete"] and b["complete"] and not journal.exists()
  assert a["resumed_rows"] >= kept and b["resumed_rows"] == 0
  assert _rows(a) == _rows(b) and len(_rows(a)) == n_rows
  for name in ("plain", "suffix", "ngram"):
    assert [(r["question_id"], r["turn"]) for r in a["prompts"][name]] == \
        [(r["question_id"], r["turn"]) for r in b["prompts"][name]]                    # same order
    for scope in ("overall", "x", "y"):
      sa = a["summary"][name]["overall" if scope == "overall" else "by_category"]
      sb = b["summary"][name]["overall" if scope == "overall" else "by_category"]
      sa, sb = (sa, sb) if scope == "overall" else (sa[scope], sb[scope])
      assert {k: sa[k] for k in SUMMARY_FIELDS} == {k: sb[k] for k in SUMMARY_FIELDS}
  assert a["summary"]["suffix"]["overall"]["acceptance_rate"] > 0

  # a resume of a complete run has nothing to do; a resume under a changed config is refused in one line
  again = subprocess.run(_bench(config, out, env, "--resume"), cwd=ROOT, env=env, capture_output=True, text=True)
  assert again.returncode == 0 and json.loads(result.read_text())["wall_seconds"] == a["wall_seconds"]
  journal.write_text(json.dumps({"format": "specjax-bench-rows-v1", "config": {**a["config"], "max_new_tokens": 8}})
                     + "\n")
  changed = subprocess.run(_bench(config, out, env, "--resume"), cwd=ROOT, env=env, capture_output=True, text=True)
  assert changed.returncode == 2 and "Traceback" not in changed.stderr
  assert changed.stderr.strip().splitlines()[-1].startswith("error: --resume: the config changed")
  assert "max_new_tokens: 8 then, 16 now" in changed.stderr


def test_eval_keeps_the_temperatures_an_interrupted_run_completed(tmp_path):
  """`specjax train eval-dflash --resume`'s evaluation: given the rows of an interrupted run, a
  temperature whose rows are all there (plain and every method) is kept as it is, the others run
  again; the result has the rows of an uninterrupted run in its order, each with its spread over
  repeats. (ngram_simple stands in for a trained drafter: the resume logic is the same.)"""
  from specjax.train.dflash_eval import evaluate
  from specjax.tune.tiny_model import tiny_target
  target = tiny_target()
  prompts = tmp_path / "q.jsonl"
  prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": t[:1]}) + "\n"
                             for i, c, t in QUESTIONS))
  methods = {"ngram n4": ("ngram_simple", None, 4, {"size_n": 2, "size_m": 4})}
  kw = dict(prompt_set=str(prompts), n_questions=3, temperatures=(0.0, 0.7), max_new_tokens=8, batch_size=3,
            progress=False, repeats=2)
  whole = evaluate(target, methods, **kw)
  assert [(r["method"], r["temperature"]) for r in whole["rows"]] == [
      ("plain", 0.0), ("ngram n4", 0.0), ("plain", 0.7), ("ngram n4", 0.7)]
  assert all(r["repeat_spread"]["n"] == 2 for r in whole["rows"])
  cut = [dict(r) for r in whole["rows"][:3]]                 # killed inside T=0.7: its plain row is not enough
  seen = []
  resumed = evaluate(target, methods, **kw, done_rows=cut, on_row=lambda r: seen.append(len(r["rows"])))
  assert resumed["rows"][:2] == cut[:2] and seen == [2, 3, 4]
  assert [(r["method"], r["temperature"], r["tokens"]) for r in resumed["rows"]] == \
      [(r["method"], r["temperature"], r["tokens"]) for r in whole["rows"]]
  assert resumed["rows"][2] is not cut[2]
