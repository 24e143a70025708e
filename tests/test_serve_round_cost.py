"""experiments/serve_round_cost.py --tiny: the GPU script's dry run on the CPU.

A tiny float32 target: the engine's decode step timed at two lengths (24 and 48 tokens: long enough
that the difference of their times is not lost in a busy machine's noise), and a one-request serving
round on 1 and 4 slots at 1 and 8 rounds per call, and prefills of 1 and 4 requests. Checked: every row present with a positive ms,
each serving row ran as many rounds as the request had tokens to make (one token per plain round,
the first coming from the prefill), and the JSON names its configuration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_serve_round_cost_has_every_row(tmp_path):
  out = tmp_path / "serve_round_cost.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPECJAX_COMPILE_CACHE": "0", "SPECJAX_GIT_REV": "test"}
  r = subprocess.run([sys.executable, str(ROOT / "experiments" / "serve_round_cost.py"), "--tiny", "--new-tokens", "48",
                      "--capacity", "128", "--slots", "1", "4", "--rounds-per-call", "1", "8", "--repeats", "3",
                      "--prefill-rows", "1", "4", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-4000:]
  res = json.loads(out.read_text())
  rows = res["rows"]
  assert rows[0]["what"] == "engine decode step" and rows[0]["ms"] > 0
  serve = {(x["slots"], x["rounds_per_call"]): x for x in rows[1:] if x["what"] == "serve round"}
  assert set(serve) == {(1, 1), (1, 8), (4, 1), (4, 8)}
  prefill = {(x["slots"], x["rows"]): x for x in rows if x["what"] == "serve prefill"}
  assert set(prefill) == {(1, 1), (4, 1), (4, 4)}                          # 4 rows only where 4 slots are
  assert all(x["calls"] == 1 and 0 < x["dispatch_ms"] <= x["ready_ms"] for x in prefill.values())
  assert all(x["ms"] > 0 and x["rounds"] == 47 and x["ratio_to_engine"] > 0 for x in serve.values())
  assert res["config"]["capacity"] == 128 and res["git_revision"] == "test"


def test_tiny_speculative_round_cost_counts_tokens_per_round(tmp_path):
  """--speculator mtp (a random head): the engine's and the server's rounds are timed, and each row
  says how many tokens a round made (at least the one the target always emits, at most n_max + 1),
  counted over the whole request alike: the same drafter on the same prompt, greedy, drafts and
  accepts the same tokens in both, so the two rows' tokens per round are equal."""
  out = tmp_path / "serve_round_cost_mtp.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPECJAX_COMPILE_CACHE": "0", "SPECJAX_GIT_REV": "test"}
  r = subprocess.run([sys.executable, str(ROOT / "experiments" / "serve_round_cost.py"), "--tiny", "--new-tokens", "48",
                      "--capacity", "128", "--slots", "1", "--rounds-per-call", "4", "--repeats", "1",
                      "--speculator", "mtp", "--n-max", "2", "--trace", "--out", str(out)],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-4000:]
  res = json.loads(out.read_text())
  engine, serve = res["rows"]
  assert engine["what"] == "engine round" and serve["what"] == "serve round" and serve["ms"] > 0
  assert 1.0 <= engine["tokens_per_round"] <= 3.0 and 1.0 <= serve["tokens_per_round"] <= 3.0
  assert abs(engine["tokens_per_round"] - serve["tokens_per_round"]) < 1e-3
  assert serve["rounds"] <= 47 and res["config"]["speculator"] == "mtp"
  # --trace: each row's profiled request ran as many rounds as its timed ones (a CPU trace has no
  # device events, so only the wall time per round is there)
  assert serve["profile"]["rounds"] == serve["rounds"] and serve["profile"]["wall_ms_per_round"] > 0
  assert engine["profile"]["rounds"] > 0 and engine["profile"]["wall_ms_per_round"] > 0


def test_greedy_argmax_patch_keeps_greedy_tokens_and_drops_the_conditional(monkeypatch):
  """--greedy-argmax (decode_flags' `greedy_argmax` patch): the engine's and the server's callers of `next_token` take a
  bare argmax, so greedy generation gives the same tokens, and the token's lowering has no
  conditional left (the model's `next_token` lowers one)."""
  import importlib.util

  import jax
  import jax.numpy as jnp

  from conftest import TINY_LLAMA, random_params
  from specjax.engine import decode, generation
  from specjax.engine.decode import generate_plain
  from specjax.engine.sampling import SamplingParams
  from specjax.serve import slot_programs
  spec = importlib.util.spec_from_file_location("serve_round_cost", ROOT / "experiments" / "serve_round_cost.py")
  module = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "serve_round_cost", module)                     # its dataclasses look it up
  spec.loader.exec_module(module)
  params = random_params(TINY_LLAMA, seed=0)
  prompts = [[3, 7, 1, 12, 5], [9, 2]]
  args = (jnp.zeros((2, TINY_LLAMA.vocab_size)), SamplingParams.make(2), jnp.zeros((2, 2), jnp.uint32))
  conditional = lambda f: "stablehlo.case" in jax.jit(f).lower(*args).as_text()

  def run():
    jax.clear_caches()
    return generate_plain(params, TINY_LLAMA, prompts, max_new_tokens=10, capacity=128).tokens

  want = run()
  assert conditional(decode.next_token)
  for m in (decode, generation, slot_programs):
    monkeypatch.setattr(m, "next_token", m.next_token)                             # restored after the test
  module.greedy_argmax()
  assert decode.next_token is generation.next_token is slot_programs.next_token
  assert not conditional(decode.next_token)
  assert run() == want
  jax.clear_caches()
