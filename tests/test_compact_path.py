"""The one-launch tree-path compaction kernel (Pallas, interpret mode on the CPU) against the XLA
reference, and tree speculation through it.

Properties checked:
- kernel == reference bitwise (a copy) on random caches and accepted paths: several arrays, bf16
  and f32, paths of every length, sources and targets past the capacity (clamped / dropped);
- the dispatcher: reference on the CPU under auto, kernel when forced;
- greedy tree speculation (draft_tree, dflash_tree) with the kernel forced is identical to plain
  decoding and to the same speculation through the reference, round for round;
- the kernel lowers to Triton for CUDA (SmolLM2's 60 cache arrays, a depth-8 path), checked on the CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_LLAMA, random_params
from specjax.drafters import speculator_spec
from specjax.drafters.base import DraftParams
from specjax.engine import speculative_generate
from specjax.engine.decode import generate_plain
from specjax.kernels import compact_path as cp
from specjax.models.load import LoadedModel


def random_path_case(n, b, s_cap, kvh, hd, n_rows, dtype, seed, near_end=False):
  rng = np.random.default_rng(seed)
  arrays = tuple(jnp.asarray(rng.standard_normal((b, s_cap, kvh, hd), np.float32), dtype) for _ in range(n))
  hi = s_cap if near_end else s_cap - 2 * n_rows
  base = jnp.asarray(rng.integers(max(hi - 2 * n_rows, 0) if near_end else 0, hi, b), jnp.int32)
  steps = rng.integers(1, 4, (b, n_rows - 1))                                       # a path's node indices rise
  src = jnp.asarray(np.concatenate([np.zeros((b, 1), np.int64), np.cumsum(steps, axis=1)], axis=1), jnp.int32)
  return arrays, base, src


@pytest.mark.parametrize("n,b,s_cap,kvh,hd,n_rows,dtype,near_end", [
    (4, 2, 64, 2, 8, 9, jnp.float32, False),
    (6, 3, 48, 3, 16, 5, jnp.bfloat16, False),
    (2, 1, 32, 1, 8, 2, jnp.float32, False),
    (4, 3, 40, 2, 8, 9, jnp.float32, True),      # sources and targets past the capacity
], ids=["f32-depth8", "bf16-gqa3", "one-row", "at-capacity"])
def test_kernel_moves_the_path_as_the_reference(n, b, s_cap, kvh, hd, n_rows, dtype, near_end):
  for seed in range(3):
    arrays, base, src = random_path_case(n, b, s_cap, kvh, hd, n_rows, dtype, seed, near_end)
    got = jax.jit(lambda a, x, s: cp.pallas_compact(a, x, s, interpret=True))(arrays, base, src)
    want = jax.jit(cp.compact_reference)(arrays, base, src)
    for g, w, x in zip(got, want, arrays):
      assert g.dtype == x.dtype and np.array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    if not near_end and np.any(np.asarray(src) != np.arange(n_rows)):   # rows changed places
      assert not np.array_equal(np.asarray(want[0], np.float32), np.asarray(arrays[0], np.float32))


def test_dispatch_reference_on_cpu_under_auto_kernel_when_forced(monkeypatch):
  arrays, base, src = random_path_case(2, 2, 32, 2, 8, 4, jnp.float32, 0)
  seen = []
  real = cp.pallas_compact
  monkeypatch.setattr(cp, "pallas_compact", lambda *a, **k: seen.append(k) or real(*a, **k))
  for impl, calls in (("auto", 0), ("xla", 0), ("pallas", 1)):
    cp.set_impl(impl)
    try:
      out = cp.compact(arrays, base, src)
    finally:
      cp.set_impl(None)
    assert len(seen) == calls, impl
    for o, w in zip(out, cp.compact_reference(arrays, base, src)):
      assert np.array_equal(np.asarray(o), np.asarray(w))
  assert seen == [{"interpret": True}]


@pytest.mark.parametrize("name", ["draft_tree", "dflash_tree"])
def test_tree_speculation_through_the_kernel_is_lossless(name, tmp_path):
  """Batch 3 greedy, 16 new tokens, a 3-level tree of 8 nodes from the registry's example drafter
  (draft_tree: a perturbed copy of the target, whose trees are often right, so accepted paths
  go through the move; dflash_tree: a random head, accepting a few)."""
  target = LoadedModel(name="tiny", cfg=TINY_LLAMA, params=random_params(TINY_LLAMA, seed=0))
  prompts = [[1, 5, 9, 3, 5, 9, 3, 5], [2, 4, 6, 2, 4], [7, 7, 7, 7, 1, 2, 7, 7, 7]]
  spec = speculator_spec.get(name)
  kw = {**spec.example(target, tmp_path), "depth": 3, "top_k": 2, "n_nodes": 8}
  runs = {}
  for impl in ("xla", "pallas"):
    cp.set_impl(impl)
    jax.clear_caches()
    try:
      drafter = spec.build(target, draft_params=DraftParams(n_max=8), **kw)
      runs[impl] = speculative_generate(target.params, target.cfg, prompts, drafter, max_new_tokens=16,
                                        draft_params=DraftParams(n_max=8))
    finally:
      cp.set_impl(None)
  jax.clear_caches()
  plain = generate_plain(target.params, target.cfg, prompts, max_new_tokens=16).tokens
  assert runs["pallas"].tokens == plain == runs["xla"].tokens
  assert runs["pallas"].stats.per_seq_rounds == runs["xla"].stats.per_seq_rounds
  print(name, runs["pallas"].stats.format())
  assert runs["pallas"].stats.acceptance_rate > 0, runs["pallas"].stats.format()


def test_kernel_lowers_to_triton_for_cuda():
  """The Triton lowering (scalar slot reads, one-row loads and masked stores, a branch per array)
  runs on the CPU via export: SmolLM2's cache (30 layers x K and V, 3 KV heads of 64), depth 8."""
  from jax import export
  from jax._src.lib import version as jaxlib_version
  if jaxlib_version > (0, 10, 2):
    pytest.skip("newer jaxlibs compile Triton at lowering time, which needs a GPU")
  sds = jax.ShapeDtypeStruct
  arrays = tuple(sds((1, 1024, 3, 64), jnp.bfloat16) for _ in range(60))
  exp = export.export(jax.jit(cp.pallas_compact), platforms=["cuda"],
                      disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
      arrays, sds((1,), jnp.int32), sds((1, 9), jnp.int32))
  assert "xla.gpu.triton" in exp.mlir_module()
