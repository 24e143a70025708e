"""experiments/sharded_round_cost.py --tiny: the GPU script's dry run on 8 simulated CPU devices.

One subprocess (the device-count flag must be set before jax starts): a tiny float32 target on one
device and on data=1,model=2, batch 2, plain decoding, EAGLE-3 chains at K = 1, 2 and an
eagle3_tree of 4 nodes (8 programs; XLA's CPU backend at optimization level 0 compiles them in
about half the time, and the numbers are not looked at, only their presence and signs). Checked:
a row per (mesh, batch, method) with positive ms and rounds, chain rounds emitting at least a token
each, the ratio to the plain step filled in, the summary printed and the PNG drawn; the sharded
decode step's collectives (two all-reduces per layer, no all-gather); a resumed run keeps both;
with --head-placement replicated sharded, each EAGLE-3 row on the sharded mesh twice. And `--merge`,
which joins runs made at once on disjoint GPUs, on hand-made files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "sharded_round_cost.py"


def test_tiny_sharded_round_cost_has_every_row_and_the_plot(tmp_path):
  out = tmp_path / "round_cost.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPECJAX_COMPILE_CACHE": "0", "SPECJAX_GIT_REV": "test",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"}
  r = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--model-sizes", "1", "2", "--batches", "2",
                      "--k", "1", "2", "--tree-nodes", "4", "--new-tokens", "8", "--prompt-len", "8",
                      "--head-placement", "replicated", "sharded",
                      "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-4000:]
  got = json.loads(out.read_text())
  assert got["device"]["n_devices"] == 8 and got["git_revision"] == "test"
  assert got["skipped"] == [], got["skipped"]
  keys = {(row["mesh"], row["batch"], row["method"], row["width"], row["heads"]) for row in got["rows"]}
  want = {(mesh, b, method, w, "replicated") for mesh in ("one device", "data=1,model=2") for b in (2,)
          for method, w in (("plain", None), ("eagle3", 1), ("eagle3", 2), ("eagle3_tree", 4))}
  want |= {("data=1,model=2", 2, method, w, "sharded") for method, w in (("eagle3", 1), ("eagle3", 2), ("eagle3_tree", 4))}
  assert keys == want and len(got["rows"]) == len(want)
  for row in got["rows"]:
    assert row["ms_per_round"] > 0 and row["rounds"] > 0 and row["seconds"] > 0, row
    assert row["tokens"] == 8 * row["batch"], row                       # no stop tokens: every token generated
    if row["method"] == "plain":
      assert row["rounds"] == 7 and row["ratio_to_plain"] is None      # the prefill sampled the first token
    else:
      assert row["ratio_to_plain"] > 0, row
    if row["method"] == "eagle3":
      assert 1.0 <= row["tau"] <= row["width"] + 1, row                # a round emits 1 .. K + 1 tokens
      assert row["rounds"] * row["batch"] * (row["width"] + 1) >= row["tokens"] - row["batch"], row
  assert "ms per plain step / verification round" in r.stdout and "eagle3_tree N=4" in r.stdout
  png = out.with_suffix(".png")
  assert png.exists() and png.stat().st_size > 10_000
  # the sharded decode step's collectives: Megatron's two all-reduces per layer and no gather
  per_layer = got["collectives"]["data=1,model=2, batch 2"]["per_layer"]
  assert per_layer["all-reduce"] == 2 and per_layer["all-gather"] == 0, got["collectives"]
  # a resumed run with nothing left to measure keeps the rows and what the first run compiled
  r = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--model-sizes", "1", "2", "--batches", "2",
                      "--k", "1", "2", "--tree-nodes", "4", "--new-tokens", "8", "--prompt-len", "8", "--resume",
                      "--head-placement", "replicated", "sharded",
                      "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-4000:]
  again = json.loads(out.read_text())
  assert again["rows"] == got["rows"] and again["collectives"] == got["collectives"]


def test_merging_runs_on_disjoint_gpus_keeps_every_row_once(tmp_path):
  """`--merge` (groups of meshes measured at once on disjoint GPUs, experiments/gpu/round_cost.sh):
  every row once, the first file's where two measured the same one; a skip stays only where no run
  measured its rows (a mesh one process lacked GPUs for, another ran); the device count is the
  machine's (the most any run saw); the first file's config. Pure bookkeeping: no jax program."""
  row = lambda mesh, b, ms, gpus: {"mesh": mesh, "batch": b, "method": "plain", "width": None, "label": "plain",
                                   "ms_per_round": ms, "ratio_to_plain": None, "gpus": gpus}
  one = {"config": {"k": [2]}, "device": {"n_devices": 1, "device_kind": "H100"}, "elapsed_s": 10.0,
         "rows": [row("one device", 8, 6.5, "0"), row("one device", 1, 6.4, "all")],
         "skipped": [{"mesh": "data=1,model=2", "why": "1 devices"}]}
  two = {"config": {"k": [8]}, "device": {"n_devices": 2, "device_kind": "H100"}, "elapsed_s": 20.0,
         "rows": [row("data=1,model=2", 8, 7.5, "1,2"), row("one device", 1, 9.9, "all")],
         "skipped": [{"mesh": "data=1,model=2", "batch": 64, "method": "plain", "width": None, "why": "time budget"}]}
  paths = []
  for i, d in enumerate((one, two)):
    paths.append(tmp_path / f"part{i}.json")
    paths[-1].write_text(json.dumps(d))
  out = tmp_path / "merged.json"
  r = subprocess.run([sys.executable, str(SCRIPT), "--merge", *map(str, paths), str(tmp_path / "absent.json"),
                      "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-4000:]
  got = json.loads(out.read_text())
  rows = {(x["mesh"], x["batch"]): x for x in got["rows"]}
  assert len(got["rows"]) == 3 and rows[("one device", 1)]["ms_per_round"] == 6.4      # the first file's
  assert rows[("data=1,model=2", 8)]["gpus"] == "1,2"
  assert got["skipped"] == [two["skipped"][0]]        # model=2 ran in the second run; batch 64 did not
  assert got["device"]["n_devices"] == 2 and got["config"] == one["config"] and got["merged_from"] == 2
  assert "data=1,model=2" in r.stdout and (tmp_path / "merged.png").exists()
