"""Several devices and hosts (`specjax.parallel`), on simulated CPU devices.

The work runs in subprocesses (tests/sharding_worker.py) started with
XLA_FLAGS=--xla_force_host_platform_device_count=8, since the flag must be set before jax starts
and the rest of the suite keeps one device. On a tiny random target (8 heads, 4 KV heads):

- greedy output of plain decoding and of every registered speculator (tiny random heads, a
  perturbed draft model, host speculators too) on a sharded target is the one-device greedy output
  (plain decoding's, computed once: every speculator equals it on one device), at
  batch 1 and 3 (3 rows on data=2 are padded to 4 by `api.generate`, the padding dropped), on meshes
  (data, model) = (1, 2), (2, 2), (2, 4). Compilation dominates (each speculator x batch x mesh is
  a new program: ~10 s of CPU each here), so the default run checks every speculator at batch 3 on
  (2, 2) and plain decoding plus one head-tree and one host speculator at batch 1 on (1, 2) and
  (2, 4) and at batch 3 on (2, 4);
  SPECJAX_SHARDING_FULL=1 checks the whole product.
- sampled speculation on a (2, 2) mesh keeps the token law (tests/token_law.py's checker);
- one MTP head-training step on a (2, 2) mesh (batch on data, frozen target sharded, features
  recomputed in the step) equals the one-device step, and a sharded orbax checkpoint resumes it;
- two processes (jax.distributed, localhost coordinator, gloo) give the one-process tokens.
Plus the pure-Python parts in this process: mesh specs, partition specs by path, the head check.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from specjax.errors import UserError
from specjax.parallel import partition
from specjax.parallel.distributed import settings_from_env
from specjax.parallel.mesh import parse_mesh

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "sharding_worker.py"
MESHES = ["data=1,model=2", "data=2,model=2", "data=2,model=4"]
SAMPLE = ["plain", "eagle3_tree", "suffix"]   # a head tree, a host speculator (a draft model: the registry test)
FULL = os.environ.get("SPECJAX_SHARDING_FULL") == "1"


def _worker(*args, env=None, timeout=1800) -> list[dict]:
  """Run tests/sharding_worker.py with 8 CPU devices; its JSON lines."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
         "SPECJAX_COMPILE_CACHE": "0", **(env or {})}
  r = subprocess.run([sys.executable, str(WORKER), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=timeout)
  assert r.returncode == 0, r.stderr[-4000:]
  return [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]


def _assert_greedy(rows: list[dict], expected: int) -> None:
  assert len(rows) == expected, rows
  bad = [f"{r['name']} batch {r['batch']} mesh {r['mesh']}: {r['got']} != {r['ref']}" for r in rows if not r["ok"]]
  assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------------------------
# in this process: no devices needed


def test_mesh_specs_parse_and_refuse_what_they_cannot_build():
  assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
  assert parse_mesh("model=2") == {"data": 1, "model": 2}
  assert parse_mesh({"data": 2}) == {"data": 2, "model": 1}
  for bad, words in [("data=2,model", "AXIS=SIZE"), ("pipe=2", "unknown axis"), ("data=0", "positive"),
                     ("data=2,data=2", "twice"), ("model=x", "positive")]:
    with pytest.raises(UserError, match=words):
      parse_mesh(bad)


def test_partition_specs_follow_the_parameter_paths():
  spec = lambda path, shape, m=4: partition.param_spec(tuple(path.split("/")), shape, m)
  assert spec("layers/0/self_attn/qkv_proj/kernel", (32, 64)) == P(None, "model")      # heads: columns
  assert spec("layers/0/self_attn/o_proj/kernel", (32, 32)) == P("model")              # rows: partial sums
  assert spec("layers/0/mlp/gate_up_proj/kernel", (32, 128)) == P(None, "model")
  assert spec("layers/0/mlp/down_proj/kernel", (64, 32)) == P("model")
  assert spec("embed_tokens/embedding", (16, 32)) == P("model")                        # vocabulary
  assert spec("lm_head/kernel", (32, 16)) == P(None, "model")
  assert spec("layers/0/input_layernorm/weight", (32,)) == P()                          # norms: replicated
  assert spec("lm_head/kernel", (32, 18)) == P()                                        # 18 % 4: replicated
  assert spec("lm_head/kernel", (32, 16), m=1) == P()


def test_the_model_axis_must_divide_the_heads():
  from specjax.models.config import ModelConfig
  cfg = ModelConfig(arch="llama", vocab_size=16, d_model=32, n_layers=1, n_heads=14, n_kv_heads=2, head_dim=8,
                    ffn_dim=64, rope_theta=1e4, norm_eps=1e-6)

  class FakeMesh:
    shape = {"data": 1, "model": 4}
  with pytest.raises(UserError, match=r"model=4 does not divide the target's 14 attention heads, 2 KV heads; "
                                      r"model can be one of 1, 2"):
    partition.check_target(cfg, FakeMesh())


def test_distributed_settings_come_from_the_environment():
  assert settings_from_env({}) is None
  env = {"SPECJAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "SPECJAX_NUM_PROCESSES": "2", "SPECJAX_PROCESS_ID": "1"}
  assert settings_from_env(env) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}
  with pytest.raises(UserError, match="SPECJAX_PROCESS_ID"):
    settings_from_env({**env, "SPECJAX_PROCESS_ID": ""})
  with pytest.raises(UserError, match=r"\[0, 2\)"):
    settings_from_env({**env, "SPECJAX_PROCESS_ID": "2"})


# ----------------------------------------------------------------------------------------------
# subprocesses with 8 CPU devices


def test_every_speculator_is_lossless_on_a_data_and_model_mesh():
  """Batch 3 on data=2,model=2: padding, batch split, heads split, for the whole registry."""
  from specjax.drafters import speculator_spec
  # the worker (a fresh process) runs the built-in registry; plugins other tests of this process
  # loaded (tests/test_registry_laws.py loads the example one) are not in it
  names = ["plain", *(n for n, s in speculator_spec.registered().items() if s.build.__module__.startswith("specjax."))]
  if FULL:
    _assert_greedy(_worker("greedy", "3", ";".join(MESHES)), len(names) * len(MESHES))
  else:
    _assert_greedy(_worker("greedy", "3", "data=2,model=2"), len(names))


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_is_the_one_device_output_on_every_mesh(batch):
  from specjax.drafters import speculator_spec
  names = ["plain", *speculator_spec.names()] if FULL else SAMPLE
  if FULL and batch == 3:
    pytest.skip("the full registry at batch 3 runs in test_every_speculator_is_lossless_on_a_data_and_model_mesh")
  # (2, 2) at batch 3 is the registry-wide test's mesh; batch 3 on (2, 4) pads the batch and splits 4 ways
  meshes = MESHES if FULL else [m for m in MESHES if m != "data=2,model=2" and (batch == 1 or m == "data=2,model=4")]
  _assert_greedy(_worker("greedy", str(batch), ";".join(meshes), ",".join(names)), len(names) * len(meshes))


def test_sampled_speculation_on_a_mesh_keeps_the_token_law():
  (row,) = _worker("law", "data=2,model=2")
  assert row["p"]["spec"] >= 1e-4 and row["p"]["two"] >= 1e-4, row
  assert 0.05 <= row["acceptance"] <= 0.95, row   # drafts are accepted and rejected: both paths sampled


def test_a_training_step_on_a_mesh_is_the_one_device_step(tmp_path):
  (row,) = _worker("train", "data=2,model=2", str(tmp_path))
  assert row["batch_sharding"] == "P('data',)" and row["sharded_frozen_leaves"] > 0, row
  assert np.isclose(row["loss"][0], row["loss"][1], rtol=1e-5), row
  assert row["step_param_diff"] < 1e-3 and row["resume_param_diff"] < 1e-3, row   # lr 1e-2: 10% of a step
  assert row["resumed_from"] == 1, row


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_give_the_one_process_tokens():
  """Two CPU processes (one device each, gloo collectives) joined by a localhost coordinator run
  the model axis across them; process 0's tokens equal one process's with both devices."""
  names = "plain,suffix"   # the device loop and a host drafter's loop
  env = {"SPECJAX_COORDINATOR_ADDRESS": f"localhost:{_free_port()}", "SPECJAX_NUM_PROCESSES": "2",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
  procs = [subprocess.Popen([sys.executable, str(WORKER), "dist", "data=1,model=2", names], cwd=ROOT,
                            env={**os.environ, **env, "SPECJAX_PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = [p.communicate(timeout=900) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-4000:]
  (multi,) = [json.loads(ln) for ln in outs[0][0].splitlines() if ln.startswith("{")]
  (single,) = _worker("dist", "data=1,model=2", names)
  assert multi["processes"] == 2 and multi["devices"] == 2 and single["processes"] == 1
  assert multi["tokens"] == single["tokens"], (multi, single)
