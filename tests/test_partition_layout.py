"""How parameters are split over a (data, model) mesh and what a sharded decode step communicates,
on 8 simulated CPU devices.

A checkpoint's q / k / v projections are loaded as one matrix (`qkv_proj`) and gate / up as one
(`gate_up_proj`), and `specjax.parallel.partition` splits the fused output axis over "model". A
device should then hold matching slices of every part: the query heads of its KV heads together
with those K and V heads, and the gate and up columns of the same MLP units, so attention and the
gated product run where the weights are. The check reads the layout from what the loader made:
each HF tensor row carries a code for (part, head or unit), the tensors go through
`weights.params_from_hf` and `place_params`, and the codes found in each device's shard are
compared.

- the forward pass on model=2 and model=4 equals the one-device forward (float32 logits);
- each device's shard of qkv_proj (kernel and bias) and gate_up_proj holds matching slices of every
  part: the fused columns are grouped per KV head and interleaved per MLP unit (`models/layers.py`),
  so a contiguous split gives every device whole groups.

The collectives XLA puts in one compiled plain decode step (`parallel.hlo.decode_step_collectives`,
per decoder layer):

- data=2: none. The KV-cache write and the history append write each row where it lives (a vmapped
  scatter); written by explicit row indices they cost 4 all-gathers per layer.
- model=2 / 4 (and with data=2): Megatron's two all-reduces (after o_proj and down_proj), nothing
  else. Fused columns split as whole parts ([Q | K | V], [gate | up]) would make XLA move the
  projected activations between devices after every fused projection (collective-permutes).
- the same on model=2 / 4 for a target whose 3 KV heads they do not divide, run padded with zero KV
  groups to 4 (`parallel.pad_heads`, as `api.shard` runs it): whole groups per device again.

The work runs in a subprocess (this file run as a script) because the device-count flag must be
set before jax starts and the rest of the suite keeps one device. On one device (in this process):
the fused rows split back into the HF parts, and `split_qkv` / `split_gate_up` read the fused
output as the HF projections' outputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MESHES = (2, 4)
COLLECTIVE_MESHES = ("data=2", "data=1,model=2", "data=1,model=4", "data=2,model=2", "data=2,model=4")
PADDED_MESHES = ("data=1,model=2", "data=1,model=4")   # 3 KV heads: padded to 4
PALLAS_MESHES = ("data=1,model=2", "data=2,model=2")


@pytest.fixture(scope="module")
def worker() -> dict:
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
         "SPECJAX_COMPILE_CACHE": "0"}
  r = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])


@pytest.mark.parametrize("model", MESHES)
def test_forward_on_model_axis_equals_one_device(worker, model):
  got = worker["forward"][str(model)]
  assert got["max_abs_diff"] < 1e-5, got
  assert got["argmax_equal"], got


@pytest.mark.parametrize("model", MESHES)
def test_each_device_holds_matching_slices_of_every_part(worker, model):
  bad = [f"{leaf} on device {d}: {what}" for leaf, devices in worker["layout"][str(model)].items()
         for d, what in enumerate(devices) if what != "ok"]
  assert not bad, "\n".join(bad)


def test_data_axis_decode_step_gathers_nothing_per_layer(worker):
  got = worker["collectives"]["data=2"]
  assert got["per_layer"] == {k: 0 for k in got["per_layer"]}, got
  assert got["outside_layers"]["all-gather"] == 0, got       # the history append stays local too


@pytest.mark.parametrize("mesh", COLLECTIVE_MESHES[1:])
def test_model_axis_decode_step_has_two_all_reduces_per_layer(worker, mesh):
  got = worker["collectives"][mesh]["per_layer"]
  assert got == {**{k: 0 for k in got}, "all-reduce": 2}, got


@pytest.mark.parametrize("mesh", PADDED_MESHES)
def test_padded_kv_heads_decode_step_has_two_all_reduces_per_layer(worker, mesh):
  got = worker["padded_collectives"][mesh]["per_layer"]
  assert got == {**{k: 0 for k in got}, "all-reduce": 2}, got


@pytest.mark.parametrize("mesh", PALLAS_MESHES)
def test_pallas_attention_runs_per_shard(worker, mesh):
  """The Pallas attention kernel (interpret mode) under a mesh: Megatron's 2 all-reduces per layer
  and nothing else (no gathering of q, k, v onto every device), and the one-device forward."""
  got = worker["pallas_collectives"][mesh]["per_layer"]
  assert got == {**{k: 0 for k in got}, "all-reduce": 2}, got
  assert worker["pallas_forward"][mesh]["max_abs_diff"] < 1e-5, worker["pallas_forward"][mesh]


def test_fused_rows_split_back_and_read_as_the_hf_projections():
  """One device, no mesh: `fuse_rows` then `split_rows` gives the HF parts back (what head files
  store), and the fused projection's output read by `split_qkv` / `split_gate_up` is each HF
  projection's output, query head i with KV head i // (H / KVH)."""
  import numpy as np

  from specjax.models.layers import gate_up_layout, qkv_layout, split_gate_up, split_qkv
  from specjax.models.weights import fuse_rows, split_rows
  h, kvh, d, f, dm = 6, 2, 4, 5, 8
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 3, dm)).astype(np.float32)                      # [B, T, d_model]
  for layout, sizes in ((qkv_layout(h, kvh, d), (h * d, kvh * d, kvh * d)), (gate_up_layout(f), (f, f))):
    parts = [rng.standard_normal((n, dm)).astype(np.float32) for n in sizes]   # HF [out, in]
    fused = fuse_rows(parts, layout)
    for got, want in zip(split_rows(fused, layout), parts):
      np.testing.assert_array_equal(got, want)
    out = np.einsum("btd,od->bto", x, fused)                                   # [B, T, sum(sizes)]
    ref = [np.einsum("btd,od->bto", x, p) for p in parts]
    if len(parts) == 3:
      q, k, v = (np.asarray(a) for a in split_qkv(out, h, kvh, d))
      np.testing.assert_allclose(q, ref[0].reshape(2, 3, h, d), rtol=1e-6, atol=1e-6)
      np.testing.assert_allclose(k, ref[1].reshape(2, 3, kvh, d), rtol=1e-6, atol=1e-6)
      np.testing.assert_allclose(v, ref[2].reshape(2, 3, kvh, d), rtol=1e-6, atol=1e-6)
    else:
      g, u = (np.asarray(a) for a in split_gate_up(out))
      np.testing.assert_allclose(g, ref[0], rtol=1e-6, atol=1e-6)
      np.testing.assert_allclose(u, ref[1], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# the subprocess


def _hf_tensors(cfg, rng, coded: bool):
  """HF-named tensors ([out, in]) of `cfg`. coded: every row of a fused part is one number that
  says (part, head or unit): 1000 * part + index (q 1, k 2, v 3, gate 4, up 5), biases likewise;
  else random values (N(0, 1/d_in) matrices, norms near 1)."""
  import numpy as np
  h, kvh, d, f, dm = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.d_model

  def mat(rows, cols, part=None, per=1):
    if coded and part is not None:
      return np.repeat((1000.0 * part + np.arange(rows) // per)[:, None], cols, axis=1).astype(np.float32)
    return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

  def vec(n, part=None, per=1):
    if coded and part is not None:
      return (1000.0 * part + np.arange(n) // per).astype(np.float32)
    return (0.1 * rng.standard_normal(n)).astype(np.float32)

  norm = lambda: (1.0 + 0.1 * rng.standard_normal(dm)).astype(np.float32)
  t = {"model.embed_tokens.weight": mat(cfg.vocab_size, dm), "model.norm.weight": norm(),
       "lm_head.weight": mat(cfg.vocab_size, dm)}
  for i in range(cfg.n_layers):
    p = f"model.layers.{i}."
    t |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
          p + "self_attn.q_proj.weight": mat(h * d, dm, 1, d), p + "self_attn.k_proj.weight": mat(kvh * d, dm, 2, d),
          p + "self_attn.v_proj.weight": mat(kvh * d, dm, 3, d), p + "self_attn.o_proj.weight": mat(dm, h * d),
          p + "self_attn.q_proj.bias": vec(h * d, 1, d), p + "self_attn.k_proj.bias": vec(kvh * d, 2, d),
          p + "self_attn.v_proj.bias": vec(kvh * d, 3, d),
          p + "mlp.gate_proj.weight": mat(f, dm, 4), p + "mlp.up_proj.weight": mat(f, dm, 5),
          p + "mlp.down_proj.weight": mat(dm, f)}
  return t


def _check_shard(codes, cfg, model: int, fused: str) -> str:
  """"ok" when one device's codes are matching slices of every part of `fused`, else what is wrong."""
  parts = {}
  for c in sorted(set(int(x) for x in codes)):
    parts.setdefault(c // 1000, set()).add(c % 1000)
  if fused == "qkv":
    kvh, group = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads
    k, v, q = parts.get(2, set()), parts.get(3, set()), parts.get(1, set())
    want_q = {g * group + j for g in k for j in range(group)}
    if len(k) != kvh // model or k != v or q != want_q:
      return f"Q heads {sorted(q)}, K heads {sorted(k)}, V heads {sorted(v)}"
  else:
    gate, up = parts.get(4, set()), parts.get(5, set())
    if len(gate) != cfg.ffn_dim // model or gate != up:
      return f"gate units {len(gate)} ({min(gate, default=None)}..), up units {len(up)} ({min(up, default=None)}..)"
  return "ok"


def main() -> None:
  sys.path.insert(0, str(ROOT))
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from specjax import parallel
  from specjax.models import decoder
  from specjax.models.config import ModelConfig
  from specjax.models.kv_cache import KVCache
  from specjax.models.weights import params_from_hf
  from specjax.parallel.hlo import decode_step_collectives

  # 8 query heads in 4 KV groups, QKV bias (qwen2's layout): model = 2 and 4 divide the KV heads
  cfg = ModelConfig(arch="qwen2", vocab_size=64, d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=4,
                    ffn_dim=64, qkv_bias=True, norm_eps=1e-6)
  rng = np.random.default_rng(0)
  params = params_from_hf(cfg, _hf_tensors(cfg, rng, coded=False))
  tokens = jnp.asarray([[3, 9, 27, 17, 51, 25, 11], [5, 1, 4, 1, 5, 9, 2]], jnp.int32)
  cache = KVCache.init(cfg, 2, 16, dtype=jnp.float32)
  fwd = jax.jit(lambda p, t, c: decoder.forward(p, cfg, t, c)[0])
  ref = np.asarray(fwd(params, tokens, cache))                                    # [B, T, V]
  coded = params_from_hf(cfg, _hf_tensors(cfg, rng, coded=True))
  out = {"forward": {}, "layout": {}}
  for m in MESHES:
    mesh = parallel.make_mesh(f"data=1,model={m}")
    with parallel.use(mesh):
      got = np.asarray(fwd(parallel.place_params(params, mesh, cfg), tokens, cache))
    out["forward"][str(m)] = {"max_abs_diff": float(np.max(np.abs(got - ref))),
                              "argmax_equal": bool((got.argmax(-1) == ref.argmax(-1)).all())}
    placed = nnx.to_pure_dict(parallel.place_params(coded, mesh, cfg))["layers"][0]
    leaves = {"qkv_proj/kernel": (placed["self_attn"]["qkv_proj"]["kernel"], "qkv", lambda s: s[:, 0]),
              "qkv_proj/bias": (placed["self_attn"]["qkv_proj"]["bias"], "qkv", lambda s: s),
              "gate_up_proj/kernel": (placed["mlp"]["gate_up_proj"]["kernel"], "gate_up", lambda s: s[:, 0])}
    layout = {}
    for name, (x, fused, row) in leaves.items():
      shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
      layout[name] = [_check_shard(row(np.asarray(s.data)), cfg, m, fused) for s in shards[:m]]
    out["layout"][str(m)] = layout
  out["collectives"] = {mesh: decode_step_collectives(cfg, parallel.make_mesh(mesh), batch=4, dtype=jnp.float32)
                        for mesh in COLLECTIVE_MESHES}
  # 6 query heads in 3 KV groups: compiled as `api.shard` runs it, padded to 4 KV groups
  odd = cfg.replace(n_heads=6, n_kv_heads=3)
  out["padded_collectives"] = {mesh: decode_step_collectives(odd, parallel.make_mesh(mesh), batch=4,
                                                             dtype=jnp.float32) for mesh in PADDED_MESHES}
  # the Pallas verification-attention kernel (what a GPU runs; interpret mode here) at a head size
  # it takes: it runs per shard, so the step communicates what the XLA attention's does, and the
  # forward equals the one-device forward with the same kernel
  from specjax.kernels import verify_attention
  verify_attention.set_impl("pallas")
  wide = cfg.replace(head_dim=16)
  out["pallas_collectives"] = {mesh: decode_step_collectives(wide, parallel.make_mesh(mesh), batch=4,
                                                             dtype=jnp.float32) for mesh in PALLAS_MESHES}
  wide_params = params_from_hf(wide, _hf_tensors(wide, rng, coded=False))
  wide_cache = KVCache.init(wide, 2, 16, dtype=jnp.float32)
  wide_fwd = jax.jit(lambda p, t, c: decoder.forward(p, wide, t, c)[0])
  ref = np.asarray(wide_fwd(wide_params, tokens, wide_cache))
  out["pallas_forward"] = {}
  for spec in PALLAS_MESHES:
    mesh = parallel.make_mesh(spec)
    with parallel.use(mesh):
      got = np.asarray(wide_fwd(parallel.place_params(wide_params, mesh, wide), tokens, wide_cache))
    out["pallas_forward"][spec] = {"max_abs_diff": float(np.max(np.abs(got - ref)))}
  verify_attention.set_impl(None)
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
