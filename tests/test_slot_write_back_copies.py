"""experiments/slot_write_back_copies.py without a model: the three write-back patterns compile
and are counted. Checked: a row per pattern with its count and temp memory, and that a one-row
dynamic_update_slice into the donated state makes no copy of it (the in-place baseline the
scatter patterns are compared with; whether the scatter copies is the backend's and XLA version's
behaviour, which the script reports rather than this test fixes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_write_back_patterns_are_counted(tmp_path):
  out = tmp_path / "copies.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPECJAX_COMPILE_CACHE": "0", "SPECJAX_GIT_REV": "test"}
  r = subprocess.run([sys.executable, str(ROOT / "experiments" / "slot_write_back_copies.py"), "--out", str(out)],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-4000:]
  rows = json.loads(out.read_text())["rows"]
  assert set(rows) == {"gather+scatter", "scatter only", "dynamic slice"}
  leaf_mb = 64 * 1024 * 3 * 64 * 2 / 1e6
  assert rows["dynamic slice"]["copies"] == 0 and rows["dynamic slice"]["temp_mb"] < leaf_mb
  assert all(isinstance(r["copies"], int) and r["temp_mb"] >= 0 for r in rows.values())
