"""experiments/decode_flags.py: the kernel count of a compiled program, and the script's CPU dry run;
experiments/profile_decode_trace.py: device busy time, gaps and kernels by kind from a trace.

`kernel_count` reads compiled HLO text: on a hand-written module whose count is known (a fusion is
one kernel whatever it fuses; a while body counts once; a conditional counts its largest branch
and its predicate; parameters, tuples and bitcasts launch nothing; a reduction's reducer and a
fused computation are not walked). The dry run (--tiny, one variant, a tiny float32 model on the
CPU, in a subprocess as the script runs its variants) writes a row with kernels per layer > 0 and a
timing per batch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "decode_flags.py"

HLO = """HloModule m, is_scheduled=true

%fused_computation (p0: f32[4], p1: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %a = f32[4]{0} add(%p0, %p1)
  ROOT %m = f32[4]{0} multiply(%a, %a)
}

%add_reducer (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %f1 = f32[4]{0} fusion(%v, %v), kind=kLoop, calls=%fused_computation
  %f2 = f32[4]{0} fusion(%f1, %v), kind=kLoop, calls=%fused_computation
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %f2)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%small (v: f32[4]) -> f32[4] {
  %v = f32[4]{0} parameter(0)
  ROOT %g = f32[4]{0} fusion(%v, %v), kind=kLoop, calls=%fused_computation
}

%large (v: f32[4]) -> f32[4] {
  %v = f32[4]{0} parameter(0)
  %g1 = f32[4]{0} fusion(%v, %v), kind=kLoop, calls=%fused_computation
  %g2 = f32[4]{0} custom-call(%g1), custom_call_target="__cublas$gemm"
  ROOT %g3 = f32[4]{0} copy(%g2)
}

ENTRY %main (a: f32[4], p: pred[]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %p = pred[] parameter(1)
  %z = s32[] constant(0)
  %t = (s32[], f32[4]{0}) tuple(%z, %a)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body
  %o = f32[4]{0} get-tuple-element(%w), index=1
  %k = f32[4]{0} conditional(%p, %o, %o), branch_computations={%small, %large}
  %b = f32[4]{0} bitcast(%k)
  %red = f32[] reduce(%b, %z), dimensions={0}, to_apply=%add_reducer
  ROOT %out = f32[4]{0} fusion(%b, %b), kind=kLoop, calls=%fused_computation
}
"""


def _module():
  spec = importlib.util.spec_from_file_location("decode_flags", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_kernel_count_counts_what_launches():
  """while: condition's compare (1) + body's 2 fusions; conditional: its predicate (1) + the larger
  branch (3); the reduce (1) and the final fusion (1); 9 in all."""
  assert _module().kernel_count(HLO) == 1 + 2 + 1 + 3 + 1 + 1


def test_tiny_dry_run_writes_kernels_and_timings(tmp_path):
  out = tmp_path / "flags.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPECJAX_COMPILE_CACHE": "0", "SPECJAX_GIT_REV": "test"}
  r = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--variants", "default", "--batch", "1",
                      "--new-tokens", "4", "--repeats", "1", "--capacity", "128", "--prompt-len", "8",
                      "--verify-tokens", "3", "--context", "16", "--out", str(out)],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-4000:]
  got = json.loads(out.read_text())
  row = got["results"]["default"]
  assert "error" not in row, row
  assert row["kernels_per_layer"] > 0 and row["kernels_outside_layers"] > 0, row
  assert row["kernels_per_step"] == row["kernels_outside_layers"] + row["n_layers"] * row["kernels_per_layer"]
  assert [x["batch"] for x in row["rows"]] == [1] and set(row["rows"][0]["seconds"]) == {"4", "8"}
  verify = row["verify_rows"]                                              # a 3-token forward in a device loop
  assert [(v["batch"], v["tokens"], v["context"]) for v in verify] == [(1, 3, 16)] and set(verify[0]["seconds"]) == {"4", "8"}
  assert got["git_revision"] == "test" and "[decode_flags] default" in r.stdout


def _profile_trace():
  """experiments/profile_decode_trace.py as a module (it imports its sibling sharding_bench)."""
  sys.path.insert(0, str(ROOT / "experiments"))
  spec = importlib.util.spec_from_file_location("profile_decode_trace", ROOT / "experiments" / "profile_decode_trace.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _trace(events):
  """A Perfetto-style trace: a host process and a GPU process with one stream, then EVENTS as
  (pid, name, ts, dur)."""
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7"}}]
  return {"traceEvents": meta + [{"ph": "X", "pid": p, "tid": 7, "name": n, "ts": t, "dur": d}
                                 for p, n, t, d in events]}


def test_trace_summary_counts_device_busy_time_and_gaps():
  """Only device events count; overlapping kernels are busy once; gaps lie between busy spans."""
  m = _profile_trace()
  device_events, summarize = m.device_events, m.summarize
  trace = _trace([(1, "PjitFunction", 0.0, 100.0),                 # host: left out
                  (2, "loop_add_fusion", 0.0, 10.0),
                  (2, "sm90_xmma_gemm_bf16", 5.0, 10.0),            # overlaps the first: busy 0..15
                  (2, "loop_add_fusion", 20.0, 5.0),                 # gap 5
                  (2, "triton_softmax", 35.0, 5.0)])                 # gap 10
  ev = device_events(trace)
  assert [e["name"] for e in ev] == ["loop_add_fusion", "sm90_xmma_gemm_bf16", "loop_add_fusion", "triton_softmax"]
  s = summarize(ev, steps=2, wall_s=50e-6, top=10)
  assert s["busy_ms_per_step"] == round(25 / 1e3 / 2, 4)
  assert s["kernel_ms_per_step"] == round(30 / 1e3 / 2, 4)
  assert s["kernels_per_step"] == 2.0
  assert s["gap_us"]["sum_ms_per_step"] == round(15 / 1e3 / 2, 4) and s["gap_us"]["median"] == 7.5
  assert s["busy_over_wall"] == 0.5
  assert s["by_kind"]["fusion"]["per_step"] == 1.0 and s["by_kind"]["gemm"]["ms_per_step"] == 0.005
  assert s["top_kernels"][0] == {"name": "loop_add_fusion", "kind": "fusion", "per_step": 1.0, "mean_us": 7.5,
                                 "share": 0.5}


def test_trace_tiny_dry_run_writes_rows(tmp_path):
  """The script runs end to end on the CPU (whose trace has no device events) and writes a row per batch."""
  main = _profile_trace().main
  out = tmp_path / "t.json"
  assert main(["--tiny", "--batch", "1", "--new-tokens", "4", "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [r["batch"] for r in rows] == [1] and rows[0]["untraced_wall_ms_per_step"] > 0


def test_hlo_index_names_kernels_as_the_trace_does():
  """Kernel-launching instructions are indexed under the trace's spelling ('.' as '_') with their
  output shape and JAX op_name; parameters, tuples and bitcasts are not."""
  hlo_index = _profile_trace().hlo_index
  text = """ENTRY %main.1 (p0: bf16[576,960]) -> f32[960] {
  %p0 = bf16[576,960]{1,0} parameter(0)
  %loop_multiply_fusion.1 = f32[576,960]{1,0} fusion(%p0), kind=kLoop, calls=%fused_multiply.1, metadata={op_name="jit(f)/...i,io->...o/dot_general" stack_frame_id=3}
  ROOT %input_reduce_fusion.20 = f32[960]{0} fusion(%loop_multiply_fusion.1), kind=kInput, calls=%fused_reduce.21
  %bitcast.3 = f32[960]{0} bitcast(%input_reduce_fusion.20)
}"""
  idx = hlo_index(text)
  assert set(idx) == {"loop_multiply_fusion_1", "input_reduce_fusion_20"}
  assert idx["loop_multiply_fusion_1"] == {"shape": "f32[576,960]{1,0}", "op": "fusion",
                                           "op_name": "jit(f)/...i,io->...o/dot_general"}
  assert idx["input_reduce_fusion_20"]["op_name"] == ""


def test_two_row_products_change_no_value(monkeypatch):
  """`layers.row_product` with its threshold at 0 (the `two_row_products` variant: every one-row
  product run as a two-row GEMM, the zero row dropped) is what a one-token forward runs (two
  barriers per projection in its lowering) and gives the same greedy tokens and the same logits as
  one-row products; the tiny model's matrices are below the default threshold, so `want` is those."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from conftest import TINY_LLAMA, random_params
  from specjax.engine.decode import generate_plain
  from specjax.models import layers
  from specjax.models.decoder import forward
  from specjax.models.kv_cache import KVCache
  sys.path.insert(0, str(ROOT / "experiments"))
  spec = importlib.util.spec_from_file_location("decode_flags", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  params = random_params(TINY_LLAMA, seed=0)

  def run():
    jax.clear_caches()
    tokens = generate_plain(params, TINY_LLAMA, [[3, 7, 1, 12, 5]], max_new_tokens=10, capacity=128).tokens
    cache = KVCache.init(TINY_LLAMA, 1, 64, dtype=jnp.float32)
    _, _, cache = forward(params, TINY_LLAMA, jnp.asarray([[3, 7, 1, 12, 5]], jnp.int32), cache)
    return tokens, np.asarray(forward(params, TINY_LLAMA, jnp.asarray([[4]], jnp.int32), cache)[0])

  want_tokens, want_logits = run()
  monkeypatch.setattr(layers, "TWO_ROW_MIN_ELEMENTS", layers.TWO_ROW_MIN_ELEMENTS)     # restored after the test
  module.PATCHES["two_row_products"]()
  got_tokens, got_logits = run()
  cache = KVCache.init(TINY_LLAMA, 1, 64, dtype=jnp.float32)
  lowered = jax.jit(lambda p, t, c: forward(p, TINY_LLAMA, t, c)[0]).lower(params, jnp.ones((1, 1), jnp.int32), cache)
  jax.clear_caches()
  assert lowered.as_text().count("optimization_barrier") == 2 * 4 * TINY_LLAMA.n_layers   # the patch ran: 4 projections
  assert got_tokens == want_tokens
  np.testing.assert_allclose(got_logits, want_logits, rtol=1e-6, atol=1e-6)


def test_in_out_products_change_no_value(monkeypatch):
  """The `in_out_products` variant's patch stores every linear weight [in, out] (the same draws,
  transposed; the layout before [out, in]) and multiplies against that layout: the same greedy
  tokens and logits as the model's own layout, on a tied and an untied (LM head through the patched head) tiny model."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from conftest import TINY_LLAMA
  from specjax.engine.decode import generate_plain
  from specjax.models import decoder, layers
  from specjax.models.decoder import forward, init_params
  from specjax.models.kv_cache import KVCache
  sys.path.insert(0, str(ROOT / "experiments"))
  spec = importlib.util.spec_from_file_location("decode_flags", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)

  def run(cfg):
    jax.clear_caches()
    params = init_params(cfg, seed=0)                                  # drawn by the (patched) modules
    tokens = generate_plain(params, cfg, [[3, 7, 1, 12, 5]], max_new_tokens=10, capacity=128).tokens
    cache = KVCache.init(cfg, 1, 64, dtype=jnp.float32)
    _, _, cache = forward(params, cfg, jnp.asarray([[3, 7, 1, 12, 5]], jnp.int32), cache)
    shapes = {tuple(x.shape) for x in jax.tree_util.tree_leaves(params)}
    return tokens, np.asarray(forward(params, cfg, jnp.asarray([[4]], jnp.int32), cache)[0]), shapes

  for cfg in (TINY_LLAMA, TINY_LLAMA.replace(tie_embeddings=False)):
    want_tokens, want_logits, want_shapes = run(cfg)
    for obj, name in ((layers.Linear, "__init__"), (layers.Linear, "__call__"), (decoder.Transformer, "head")):
      monkeypatch.setattr(obj, name, getattr(obj, name))                     # restored after the test
    module.PATCHES["in_out_products"]()
    got_tokens, got_logits, got_shapes = run(cfg)
    monkeypatch.undo()
    assert got_shapes != want_shapes                                          # the patch ran: kernels [in, out]
    assert got_tokens == want_tokens
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)


def test_scatter_cache_write_changes_no_value(monkeypatch):
  """The model's batch-1 KV-cache write (one slice update at the row's length) and the
  `scatter_cache_write` variant's (the per-row scatter that drops slots past the capacity, the
  model's write before) write the same caches within the capacity: the same greedy tokens for one
  prompt and for a ragged batch of two (which scatters either way), and bitwise the same keys and
  values after a prefill and a one-token step; the model's batch-1 step lowers with no scatter,
  the variant's with one."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from conftest import TINY_LLAMA, random_params
  from specjax.engine.decode import generate_plain
  from specjax.models import kv_cache
  from specjax.models.decoder import forward
  spec = importlib.util.spec_from_file_location("decode_flags", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  params = random_params(TINY_LLAMA, seed=0)
  prompts = [[3, 7, 1, 12, 5], [9, 2]]

  def run():
    jax.clear_caches()
    tokens = [generate_plain(params, TINY_LLAMA, p, max_new_tokens=10, capacity=128).tokens
              for p in (prompts[:1], prompts)]
    cache = kv_cache.KVCache.init(TINY_LLAMA, 1, 64, dtype=jnp.float32)
    _, _, cache = forward(params, TINY_LLAMA, jnp.asarray([prompts[0]], jnp.int32), cache)
    _, _, cache = forward(params, TINY_LLAMA, jnp.asarray([[4]], jnp.int32), cache)
    return tokens, [np.asarray(x) for x in jax.tree_util.tree_leaves(cache)]

  def step_text():
    cache = kv_cache.KVCache.init(TINY_LLAMA, 1, 64, dtype=jnp.float32)
    return jax.jit(lambda p, t, c: forward(p, TINY_LLAMA, t, c)[2]).lower(params, jnp.ones((1, 1), jnp.int32),
                                                                          cache).as_text()

  want_tokens, want_cache = run()
  want_text = step_text()
  monkeypatch.setattr(kv_cache.KVCache, "write", kv_cache.KVCache.write)          # restored after the test
  module.PATCHES["scatter_cache_write"]()
  got_tokens, got_cache = run()
  got_text = step_text()
  jax.clear_caches()
  assert "scatter" not in want_text and "scatter" in got_text                    # the patch ran
  assert got_tokens == want_tokens
  for got, want in zip(got_cache, want_cache):
    np.testing.assert_array_equal(got, want)


def test_norm_after_projection_changes_values_by_rounding_only(monkeypatch):
  """The `norm_after_projection` variant's patch (RMSNorm's 1 / rms applied to the projection's
  output, its weight to the input) computes the same layer in float32: the same greedy tokens, and
  logits within float32 rounding, for the llama block; the patched forward's lowering has no
  normed activation of its own (fewer multiplies by the rms, checked by the values' equality
  only, the kernel count being a GPU matter)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from conftest import TINY_LLAMA, random_params
  from specjax.engine.decode import generate_plain
  from specjax.models import decoder
  from specjax.models.decoder import forward
  from specjax.models.kv_cache import KVCache
  spec = importlib.util.spec_from_file_location("decode_flags", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  params = random_params(TINY_LLAMA, seed=0)
  prompt = [3, 7, 1, 12, 5]

  def run():
    jax.clear_caches()
    tokens = generate_plain(params, TINY_LLAMA, [prompt], max_new_tokens=10, capacity=128).tokens
    cache = KVCache.init(TINY_LLAMA, 1, 64, dtype=jnp.float32)
    logits, _, cache = forward(params, TINY_LLAMA, jnp.asarray([prompt], jnp.int32), cache)
    step, _, _ = forward(params, TINY_LLAMA, jnp.asarray([[4]], jnp.int32), cache)
    return tokens, np.asarray(logits), np.asarray(step)

  want = run()
  model_call = decoder.Block.__call__
  monkeypatch.setattr(decoder.Block, "__call__", model_call)                       # restored after the test
  module.PATCHES["norm_after_projection"]()
  assert decoder.Block.__call__ is not model_call                                  # the patch ran
  got = run()
  jax.clear_caches()
  assert got[0] == want[0]
  for g, w in zip(got[1:], want[1:]):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_single_pass_decode_attention_keeps_the_tokens(monkeypatch):
  """The `single_pass_decode_attention` variant's patch (one-token attention without splits, so
  nothing to merge) decodes the same greedy tokens as the split kernel, both through the Pallas
  kernel (interpret mode on the CPU), for one prompt and a ragged batch of two; the patched tiling
  of a one-token step has no split and a verification's keeps its own."""
  import jax

  from conftest import TINY_LLAMA, random_params
  from specjax.engine.decode import generate_plain
  from specjax.kernels import verify_attention as va
  spec = importlib.util.spec_from_file_location("decode_flags", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = TINY_LLAMA.replace(head_dim=16)                                # the kernel takes head_dim >= 16
  params = random_params(cfg, seed=0)
  prompts = [[3, 7, 1, 12, 5], [9, 2]]

  def run():
    jax.clear_caches()
    return [generate_plain(params, cfg, p, max_new_tokens=8, capacity=128).tokens for p in (prompts[:1], prompts)]

  va.set_impl("pallas")
  try:
    want = run()
    monkeypatch.setattr(va, "tiling_for", va.tiling_for)                           # restored after the test
    module.PATCHES["single_pass_decode_attention"]()
    shape = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 128)
    assert va.tiling_for(1, 1, *shape, sm_count=132).n_splits == 0
    assert va.tiling_for(1, 4, *shape, sm_count=132).n_splits > 0
    got = run()
  finally:
    va.set_impl(None)
    jax.clear_caches()
  assert got == want
