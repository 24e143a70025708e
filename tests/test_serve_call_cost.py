"""experiments/serve_call_cost.py --tiny: the GPU script's dry run on the CPU.

A tiny float32 target, one request: every layout (1 slot, 64 slots gathered into bucket 1, 64 slots
in full) with host and device inputs has a row with positive call and fetch times at 1 and 8 rounds
per call, its per-round and fixed costs read off as the docstring says, and the JSON names its
configuration and revision.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_serve_call_cost_has_every_row(tmp_path):
  out = tmp_path / "serve_call_cost.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPECJAX_COMPILE_CACHE": "0", "SPECJAX_GIT_REV": "test"}
  r = subprocess.run([sys.executable, str(ROOT / "experiments" / "serve_call_cost.py"), "--tiny", "--calls", "2",
                      "--capacity", "128", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-4000:]
  res = json.loads(out.read_text())
  rows = res["rows"]
  assert [(x["layout"], x["inputs"]) for x in rows] == [
      (layout, inputs) for layout in ("1 slot", "64 slots, bucket 1", "64 slots, full") for inputs in ("host", "device")]
  for x in rows:
    one, eight = x["rounds"]["1"], x["rounds"]["8"]
    assert all(v > 0 for t in (one, eight) for v in t.values())
    assert x["round_ms"] == pytest.approx((eight["call_ms"] - one["call_ms"]) / 7, abs=1e-3)
    assert x["fixed_ms"] == pytest.approx(one["call_ms"] - x["round_ms"], abs=1e-3)
  assert res["config"]["capacity"] == 128 and res["git_revision"] == "test"
