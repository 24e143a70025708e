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
- two processes (jax.distributed, localhost coordinator, gloo) give the one-process tokens;
- a target whose 3 KV heads model=2 and 4 do not divide (6 heads) runs padded to 4 KV heads
  (`parallel.pad_heads`) with the one-device greedy output: plain decoding on both meshes, an MTP
  head loaded from a head file made for the unpadded config (model=2), an EAGLE-3 tree (model=4);
  the real SmolLM2-135M (3 KV heads) on model=2 too (float32, plain decoding).
Plus the parts that need no mesh, in this process: mesh specs, partition specs by path, the head
check, and the padding itself (shapes, zeros, and a padded model's forward equal to the unpadded
one for plain, gemma3-style and hybrid gated attention).
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
  # kernels [out, in]
  assert spec("layers/0/self_attn/qkv_proj/kernel", (64, 32)) == P("model")            # heads: outputs
  assert spec("layers/0/self_attn/o_proj/kernel", (32, 32)) == P(None, "model")        # inputs: partial sums
  assert spec("layers/0/mlp/gate_up_proj/kernel", (128, 32)) == P("model")
  assert spec("layers/0/mlp/down_proj/kernel", (32, 64)) == P(None, "model")
  assert spec("embed_tokens/embedding", (16, 32)) == P("model")                        # vocabulary
  assert spec("lm_head/kernel", (16, 32)) == P("model")
  assert spec("layers/0/input_layernorm/weight", (32,)) == P()                          # norms: replicated
  assert spec("lm_head/kernel", (18, 32)) == P()                                        # 18 % 4: replicated
  assert spec("lm_head/kernel", (16, 32), m=1) == P()


def test_a_model_axis_that_does_not_divide_the_kv_heads_pads_them_and_whole_groups_are_required():
  """14 heads / 2 KV heads on model=4: padded to 4 KV heads and 28 heads (whole groups of 7); model=2
  divides them as they are. Query heads that do not form whole groups (a config ModelConfig itself
  refuses) cannot be split over any model axis: a UserError."""
  from types import SimpleNamespace

  from specjax.models.config import ModelConfig
  cfg = ModelConfig(arch="llama", vocab_size=16, d_model=32, n_layers=1, n_heads=14, n_kv_heads=2, head_dim=8,
                    ffn_dim=64, rope_theta=1e4, norm_eps=1e-6)

  class FakeMesh:
    def __init__(self, m):
      self.shape = {"data": 1, "model": m}
  partition.check_target(cfg, FakeMesh(4))
  padded = partition.padded_config(cfg, FakeMesh(4))
  assert (padded.n_heads, padded.n_kv_heads) == (28, 4) and padded.replace(n_heads=14, n_kv_heads=2) == cfg
  assert partition.padded_config(cfg, FakeMesh(2)) is cfg
  with pytest.raises(UserError, match=r"model=4 cannot split the target's attention: its 14 attention heads do not "
                                      r"form whole groups over its 4 KV heads"):
    partition.check_target(SimpleNamespace(n_heads=14, n_kv_heads=4), FakeMesh(4))
  with pytest.raises(ValueError, match="pad them first"):        # placement wants the padded config
    partition.place_params({}, FakeMesh(4), cfg)


def test_a_padded_target_keeps_its_logical_config_and_refuses_head_training():
  """`LoadedModel.logical_cfg` is the checkpoint's config (what drafters are built for): `cfg` unless
  the target was padded for a mesh; head training refuses a padded target (it builds the head and
  runs the target from one config)."""
  from specjax.models.config import ModelConfig
  from specjax.models.load import LoadedModel, require_unpadded
  cfg = ModelConfig(arch="llama", vocab_size=16, d_model=32, n_layers=1, n_heads=6, n_kv_heads=3, head_dim=4,
                    ffn_dim=64)
  plain = LoadedModel(name="t", cfg=cfg, params=None)
  assert plain.logical_cfg is cfg
  require_unpadded(plain, "MTP head training")
  padded = LoadedModel(name="t", cfg=partition.with_kv_heads(cfg, 4), params=None, unpadded_cfg=cfg)
  assert padded.logical_cfg is cfg and (padded.cfg.n_heads, padded.cfg.n_kv_heads) == (8, 4)
  with pytest.raises(UserError, match="MTP head training needs the target as loaded"):
    require_unpadded(padded, "MTP head training")


def _tiny_hybrid():
  from specjax.models.hybrid_config import HybridConfig
  return HybridConfig(arch="qwen3_5", vocab_size=16, d_model=32, n_layers=2, layer_types=("linear", "full"),
                      n_heads=6, n_kv_heads=3, head_dim=8, ffn_dim=64, lin_k_heads=1, lin_v_heads=2,
                      lin_k_dim=8, lin_v_dim=8, attn_bias=True, rotary_dim=4)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "hybrid"])
def test_padding_kv_groups_keeps_the_forward(arch):
  """`pad_heads` 3 -> 4 KV heads (6 -> 8 heads): the padded tree has the padded config's shapes, the
  checkpoint's values in front and zeros appended (qkv_proj rows and bias: one group of (G+2)*D,
  or (2G+2)*D for gated attention; o_proj: G*D columns), and the padded model's logits over a prompt
  equal the unpadded model's (float32, up to summation order); its KV cache holds the unpadded K/V
  in the first 3 heads and zeros in the fourth. qwen2: QKV bias; gemma3: QK-norm over head_dim
  shared by the heads, sliding layers; hybrid: gated attention (query | gate per head) beside a
  DeltaNet layer, which is left as it is."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from conftest import TINY_GEMMA, TINY_LLAMA, random_params
  from specjax.models import decoder, hybrid
  from specjax.models.kv_cache import KVCache
  from specjax.models.recurrent_state import HybridState
  if arch == "hybrid":
    cfg, init = _tiny_hybrid(), hybrid.init_params
    params = init(cfg, seed=0)
    pure0 = nnx.to_pure_dict(params)
    for layer in pure0["layers"].values():   # init_params zeroes biases: nonzero ones must not reach a zero group
      if "self_attn" in layer:
        layer["self_attn"]["qkv_proj"]["bias"] = jnp.full_like(layer["self_attn"]["qkv_proj"]["bias"], 0.1)
    nnx.replace_by_pure_dict(params, pure0)
    run = jax.jit(lambda p, c, t: hybrid.hybrid_forward(p, c, t, HybridState.init(c, 1, 16)), static_argnums=1)
    kv_of = lambda out: out[2].kv
    group = 2 * 2 + 2                                                              # 2G+2 head slots
  else:
    base = TINY_LLAMA.replace(arch="qwen2", qkv_bias=True) if arch == "qwen2" else TINY_GEMMA
    cfg, init = base.replace(n_heads=6, n_kv_heads=3, head_dim=4), decoder.init_params
    params = random_params(cfg, seed=3)
    run = jax.jit(lambda p, c, t: decoder.forward(p, c, t, KVCache.init(c, 1, 16)), static_argnums=1)
    kv_of = lambda out: out[2]
    group = 2 + 2                                                                  # G+2 head slots
  padded_params, padded = partition.pad_heads(params, cfg, 4)
  assert (padded.n_heads, padded.n_kv_heads) == (8, 4) and padded.replace(n_heads=6, n_kv_heads=3) == cfg
  want = init(padded)
  shape_of = lambda tree: jax.tree_util.tree_map(np.shape, nnx.to_pure_dict(tree))
  assert shape_of(padded_params) == shape_of(want)
  before, after = nnx.to_pure_dict(params), nnx.to_pure_dict(padded_params)
  d = cfg.head_dim
  for i, layer in after["layers"].items():
    if "self_attn" not in layer:
      assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, layer, before["layers"][i]))
      continue
    attn, attn0 = layer["self_attn"], before["layers"][i]["self_attn"]
    for leaf, axis, n in (("qkv_proj/kernel", 0, group * d), ("qkv_proj/bias", 0, group * d),
                          ("o_proj/kernel", 1, 2 * d)):
      mod, name = leaf.split("/")
      if attn[mod].get(name) is None:
        continue
      new, old = np.asarray(attn[mod][name]), np.asarray(attn0[mod][name])
      assert new.shape[axis] == old.shape[axis] + n, (leaf, new.shape, old.shape)
      np.testing.assert_array_equal(np.take(new, np.arange(old.shape[axis]), axis=axis), old)
      assert not np.take(new, np.arange(old.shape[axis], new.shape[axis]), axis=axis).any(), leaf
  tokens = jnp.asarray([[3, 9, 1, 12, 5, 7, 2, 11, 4]], jnp.int32)
  ref, got = run(params, cfg, tokens), run(padded_params, padded, tokens)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=1e-5, atol=1e-5)
  for k, k0 in zip(kv_of(got).k + kv_of(got).v, kv_of(ref).k + kv_of(ref).v):
    np.testing.assert_allclose(np.asarray(k)[:, :, :3], np.asarray(k0), rtol=1e-5, atol=1e-5)
    assert not np.asarray(k)[:, :, 3:].any()


def test_the_fused_decode_layer_is_refused_on_a_mesh(monkeypatch):
  """SPECJAX_FUSED_DECODE=1 runs kernels XLA cannot split: sharding a model with it on is a
  UserError that names the variable (a mesh of one device is enough to ask)."""
  from specjax import api
  from specjax.models.load import LoadedModel
  from conftest import TINY_LLAMA, random_params
  monkeypatch.setenv("SPECJAX_FUSED_DECODE", "1")
  with pytest.raises(UserError, match="SPECJAX_FUSED_DECODE=1 runs on one device"):
    api.shard(LoadedModel("tiny", TINY_LLAMA, random_params(TINY_LLAMA, 0)), "data=1,model=1")


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
  # (2, 2) at batch 3 is the registry-wide test's mesh; batch 3 on (2, 4) pads the batch and splits 4 ways;
  # batch 1 runs on (2, 4) alone unless FULL (data and model split at once; the sampled-law test
  # runs on (2, 2), the registry-wide one on (2, 2) at batch 3)
  meshes = MESHES if FULL else ["data=2,model=4"]
  _assert_greedy(_worker("greedy", str(batch), ";".join(meshes), ",".join(names)), len(names) * len(meshes))


def test_heads_split_over_the_model_axis_keep_the_one_device_output():
  """`head_placement="sharded"`: the MTP, EAGLE-3 and DFlash heads split over "model" by the target's
  rules (their attention and MLP, EAGLE-3's own LM head by vocabulary) and the MTP / EAGLE-3 KV
  caches by heads with them: the greedy output is still the one-device plain output, at batch 3 on
  (2, 2), and the heads are split (leaves not replicated)."""
  rows = _worker("heads", "3", "data=2,model=2", "mtp,eagle3_tree,dflash_tree")
  _assert_greedy(rows, 3)
  for r in rows:
    assert r["split_leaves"] > 0, r
    assert r["kv_on_model"] == (r["name"] != "dflash_tree"), r      # DFlash keeps features, no KV cache


def test_a_head_placement_other_than_replicated_or_sharded_is_refused():
  from specjax import api
  from specjax.models.load import LoadedModel
  with pytest.raises(UserError, match="head_placement must be one of replicated, sharded, got 'split'"):
    api.shard(LoadedModel(name="t", cfg=None, params=None), "data=1,model=1", head_placement="split")
  with pytest.raises(UserError, match="heads must be one of"):
    partition.place_drafter(object(), None, None, "split")


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


def test_kv_heads_the_model_axis_does_not_divide_are_padded_and_give_the_one_device_tokens(tmp_path):
  """6 heads / 3 KV heads, batch 1, 8 new tokens: plain decoding on model=2 and 4, an MTP head (from a
  head file made for the 3-KV-head config: the drafter keeps it while the target runs padded) on
  model=2, an EAGLE-3 tree on model=4."""
  rows = _worker("padded", "data=1,model=2:plain,mtp;data=1,model=4:plain,eagle3_tree", str(tmp_path))
  assert [(r["mesh"][7:], r["name"]) for r in rows] == [("model=2", "plain"), ("model=2", "mtp"),
                                                         ("model=4", "plain"), ("model=4", "eagle3_tree")], rows
  assert all(r["cfg"] == [8, 4] and r["logical"] == [6, 3] for r in rows), rows
  assert len(set(rows[0]["ref"][0])) > 4, rows[0]      # a varied output, not one token repeated
  bad = [f"{r['name']} mesh {r['mesh']}: {r['got']} != {r['ref']}" for r in rows if not r["ok"]]
  assert not bad, "\n".join(bad)


@pytest.mark.real
def test_smollm2_shards_over_model_2_padded_with_the_one_device_tokens(smollm2_path):
  """The real SmolLM2-135M (9 heads, 3 KV heads) on model=2 runs padded to 12 heads / 4 KV heads and
  answers a chat prompt with the one-device greedy tokens (float32, 8 tokens)."""
  (row,) = _worker("real", str(smollm2_path), "data=1,model=2")
  assert row["cfg"] == [12, 4] and row["logical"] == [9, 3], row
  assert row["ok"] and len(row["ref"][0]) == 8, row


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
