"""experiments/serve_round_cost.py --tiny: the GPU script's dry run on the CPU.

A tiny float32 target: the engine's decode step timed at two lengths, and a one-request serving
round on 1 and 4 slots at 1 and 8 rounds per call. Checked: every row present with a positive ms,
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
  r = subprocess.run([sys.executable, str(ROOT / "experiments" / "serve_round_cost.py"), "--tiny", "--new-tokens", "16",
                      "--capacity", "128", "--slots", "1", "4", "--rounds-per-call", "1", "8", "--repeats", "3",
                      "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-4000:]
  res = json.loads(out.read_text())
  rows = res["rows"]
  assert rows[0]["what"] == "engine decode step" and rows[0]["ms"] > 0
  serve = {(x["slots"], x["rounds_per_call"]): x for x in rows[1:]}
  assert set(serve) == {(1, 1), (1, 8), (4, 1), (4, 8)}
  assert all(x["ms"] > 0 and x["rounds"] == 15 and x["ratio_to_engine"] > 0 for x in serve.values())
  assert res["config"]["capacity"] == 128 and res["git_revision"] == "test"
