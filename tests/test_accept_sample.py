"""The accept / resample kernel (Pallas, interpret mode on the CPU) against its XLA reference.

Properties checked:
- same uniforms and Gumbel noise -> the kernel returns exactly the reference's accepted counts and
  tokens, on random inputs: batch 1..8, K = 0..16, vocabularies that are not a multiple of the
  block, one or several vocabulary splits, with and without draft distributions q, f32 and bf16
  probabilities, ragged draft lengths (0 and K included), greedy (one-hot) targets;
- a rejection whose residual is empty (p = q) falls back to sampling p_n, in both;
- the law: `accept_drafts` routed through the kernel (noise drawn from the keys) emits blocks that
  follow the exact law of speculative sampling (chi-square, as tests/test_verify.py), first token ~ p_0;
- the engine's sampled output is the same token for token with the kernel and the reference;
- the dispatcher: reference on the CPU under auto, kernel when forced, a kernel that fails to
  compile falls back with one warning, a passing probe inside a traced loop selects the kernel;
- the kernel lowers to Triton for CUDA (SmolLM2's vocabulary), checked on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import chi2_gof
from specjax.kernels import accept_sample as asl
from specjax.kernels import dispatch
from specjax.engine.verify import accept_drafts
from test_verify import P_PASS, TV_PASS, _block_counts, _exact_block_law, _first_token_stats


def random_round(b, k, v, *, has_q, dtype, seed, greedy_rows=0):
  """p [B, K+1, V], drafts mostly sampled from q (so that prefixes are accepted), ragged lengths,
  uniforms [B, K] and Gumbel noise [B, V]."""
  rng = np.random.default_rng(seed)
  logits = rng.standard_normal((b, k + 1, v)).astype(np.float32) * 4.0    # peaked: prefixes get accepted
  p = np.array(jax.nn.softmax(logits, axis=-1))
  q_logits = logits[:, :k] + rng.standard_normal((b, k, v)).astype(np.float32) * 0.7
  q = np.array(jax.nn.softmax(q_logits, axis=-1))
  draft = np.stack([[rng.choice(v, p=q[i, j] / q[i, j].sum()) for j in range(k)] for i in range(b)]).reshape(b, k)
  if greedy_rows:   # the last rows: one-hot targets, drafts right on the first half
    p[-greedy_rows:] = np.eye(v, dtype=np.float32)[logits[-greedy_rows:].argmax(-1)]
    draft[-greedy_rows:, :k // 2] = logits[-greedy_rows:, :k // 2].argmax(-1)
  dlen = rng.integers(min(1, k), k + 1, b)
  if b >= 2:
    dlen[0], dlen[1] = 0, k
  u = rng.random((b, k)).astype(np.float32)
  g = rng.gumbel(size=(b, v)).astype(np.float32)
  return (jnp.asarray(p, dtype), jnp.asarray(draft, jnp.int32), jnp.asarray(dlen, jnp.int32), jnp.asarray(u),
          jnp.asarray(g), jnp.asarray(q, dtype) if has_q else None)


# (B, K, V, q given, dtype, tiling overrides, greedy rows)
CASES = [
    (1, 1, 1000, True, jnp.float32, {}, 0),                                  # one block, one split
    (1, 4, 1000, False, jnp.float32, dict(block_v=64, n_splits=16), 0),      # batch 1: many splits
    (8, 16, 333, True, jnp.bfloat16, dict(block_v=32, n_splits=4), 2),       # K=16, bf16, ragged tail
    (4, 4, 1500, False, jnp.float32, {}, 1),                                 # default plan: 2 splits
    (3, 8, 100, False, jnp.bfloat16, dict(block_v=16, n_splits=3), 0),
    (5, 12, 257, True, jnp.float32, dict(block_v=64, n_splits=5), 0),        # 5 blocks, 1 per split
    (6, 2, 77, True, jnp.float32, dict(block_v=16, n_splits=2), 0),          # uneven blocks per split
    (2, 0, 50, False, jnp.float32, dict(block_v=16, n_splits=2), 0),         # K=0: p_0 only
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}K{c[1]}V{c[2]}{'-q' if c[3] else ''}"
                         f"-{jnp.dtype(c[4]).name}")
def test_kernel_matches_reference(case):
  b, k, v, has_q, dtype, override, greedy_rows = case
  args = random_round(b, k, v, has_q=has_q, dtype=dtype, seed=b * 100 + k * 10 + v, greedy_rows=greedy_rows)
  tl = dataclasses.replace(asl.tiling_for(b, k, v, sm_count=132), **override)
  got = jax.jit(functools.partial(asl.pallas_accept_sample, tiling=tl, interpret=True))(*args)
  want = jax.jit(asl.accept_sample_reference)(*args)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  n_acc, dlen = np.asarray(got[0]), np.asarray(args[2])
  assert (n_acc <= dlen).all()
  if k >= 4 and b >= 3:   # the inputs exercise rejections and accepted prefixes
    assert (n_acc < dlen).any() and (n_acc > 0).any()


def test_empty_residual_falls_back_to_p():
  """p = q with a zero at the drafted token: the draft is rejected (u * 0 < 0 never holds) and
  max(p - q, 0) is empty, so the token is the Gumbel-max of p_n itself, in kernel and reference."""
  b, k, v = 3, 2, 40
  rng = np.random.default_rng(5)
  p = rng.dirichlet(np.ones(v), size=(b, k + 1)).astype(np.float32)
  p[:, :, :5] = 0.0
  p /= p.sum(-1, keepdims=True)
  q = p[:, :k].copy()
  draft = np.full((b, k), 3, np.int32)                                           # p(d) = q(d) = 0
  g = rng.gumbel(size=(b, v)).astype(np.float32)
  args = (jnp.asarray(p), jnp.asarray(draft), jnp.full((b,), k, jnp.int32),
          jnp.asarray(rng.random((b, k)).astype(np.float32)), jnp.asarray(g), jnp.asarray(q))
  tl = asl.Tiling(block_k=16, block_v=16, n_splits=2)
  with np.errstate(divide="ignore"):
    want = np.argmax(np.log(p[:, 0]) + g, axis=-1)
  for n_acc, tok in (asl.pallas_accept_sample(*args, tiling=tl, interpret=True), asl.accept_sample_reference(*args)):
    np.testing.assert_array_equal(np.asarray(n_acc), 0)
    np.testing.assert_array_equal(np.asarray(tok), want)


N = 100_000       # rounds per law test (in chunks: interpret mode copies its operands per program)
CHUNK = 1000


@pytest.fixture
def impl():
  yield asl.set_impl
  asl.set_impl(None)


@pytest.mark.parametrize("with_q", [True, False], ids=["q", "deterministic"])
def test_emitted_block_follows_the_exact_law(impl, with_q):
  """`accept_drafts` through the kernel: over 100k rounds (keys -> uniforms and Gumbel noise ->
  kernel) the first emitted token is ~ p_0 (chi-square p >= 1e-4, TV <= 0.01) and the whole block
  (accepted count and every token) follows the exact law of speculative sampling."""
  v, k = 6, 2
  rng = np.random.default_rng(21 + with_q)
  p = rng.dirichlet(np.ones(v), size=k + 1).astype(np.float32)
  if with_q:
    q = rng.dirichlet(np.ones(v), size=k).astype(np.float32)
    draft = np.stack([rng.choice(v, size=N, p=qi / qi.sum()) for qi in q.astype(np.float64)], axis=1)
  else:
    q = None
    draft = np.broadcast_to(np.array([int(np.argsort(p[0])[-2]), int(rng.integers(v))]), (N, k))
  keys = jax.random.key_data(jax.random.split(jax.random.key(7), N))             # [N, 2]
  impl("pallas")

  @jax.jit
  def rounds(draft, keys):   # chunks of CHUNK rows, one kernel call each
    def chunk(x):
      d, kk = x
      pb = jnp.broadcast_to(jnp.asarray(p), (CHUNK, k + 1, v))
      qb = None if q is None else jnp.broadcast_to(jnp.asarray(q), (CHUNK, k, v))
      return accept_drafts(pb, d, jnp.full((CHUNK,), k, jnp.int32), kk, qb)
    out = jax.lax.map(chunk, (draft.reshape(-1, CHUNK, k), keys.reshape(-1, CHUNK, 2)))
    return out[0].reshape(-1), out[1].reshape(-1)

  n_acc, nxt = rounds(jnp.asarray(draft, jnp.int32), keys)
  pval, tv = _first_token_stats(n_acc, draft, nxt, p[0])
  assert pval >= P_PASS and tv <= TV_PASS, f"first token not ~ p0: p-value {pval:.3g}, TV {tv:.4f}"
  law = _exact_block_law(p, q if with_q else np.eye(v, dtype=np.float32)[draft[0]], k)
  counts = _block_counts(n_acc, draft, nxt, law)
  probs = np.asarray(list(law.values()))
  assert not ((counts > 0) & (probs == 0)).any(), "blocks of probability 0 were emitted"
  _, df, pval_block = chi2_gof(counts, probs)
  assert pval_block >= P_PASS, f"emitted block does not follow the exact law: p-value {pval_block:.3g} (df {df})"


def test_engine_sampling_identical_through_kernel(impl, tiny_llama):
  """Sampled speculative decoding (draft model with q, temperature 1) emits the same tokens with the
  kernel forced as with the reference: the noise comes from the same keys."""
  from conftest import perturb
  from specjax.drafters.draft_model import DraftModelDrafter
  from specjax.engine import speculative_generate
  from specjax.engine.sampling import SamplingParams
  cfg, params = tiny_llama
  drafter = DraftModelDrafter(cfg=cfg, max_draft=3, weights=perturb(params, 0.05, seed=1))
  prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8]]
  out = {}
  for name in ("xla", "pallas"):
    impl(name)
    jax.clear_caches()                                   # the choice is made at trace time
    res = speculative_generate(params, cfg, prompts, drafter, max_new_tokens=12,
                               sampling=SamplingParams.make(2, temperature=1.0, seed=3))
    out[name] = (res.tokens, res.stats.rounds)
  assert out["pallas"] == out["xla"]


def test_dispatch(impl, monkeypatch):
  impl(None)
  monkeypatch.delenv(asl.IMPL_ENV, raising=False)
  assert asl.choose((2, 5, 100), jnp.float32, True)[0] == "xla"                  # auto on the CPU
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  assert asl.choose((2, 5, 100), jnp.float32, True)[0] == "xla"                  # auto on a GPU: opt-in kernel
  monkeypatch.setattr(dispatch, "on_gpu", lambda: False)
  monkeypatch.setenv(asl.IMPL_ENV, "pallas")
  name, tl = asl.choose((2, 5, 100), jnp.float32, True)
  assert name == "pallas" and tl == asl.tiling_for(2, 4, 100)
  impl("xla")                                                                    # set_impl beats the env
  assert asl.choose((2, 5, 100), jnp.float32, True)[0] == "xla"
  impl(None)
  monkeypatch.setenv(asl.IMPL_ENV, "bogus")
  with pytest.raises(ValueError):
    asl.choose((2, 5, 100), jnp.float32, True)


def test_tiling_fills_the_gpu():
  """Sequences x splits reach 2x the SMs where the vocabulary has enough blocks; K fits block_k."""
  for b in (1, 8, 32, 64):
    for k in (0, 4, 8, 16):
      tl = asl.tiling_for(b, k, 49152, sm_count=132)
      assert tl.block_k >= max(k, 16) and tl.block_v == 1024
      assert b * tl.n_splits >= 264 or tl.n_splits == 48
      assert b * tl.n_splits < 264 + b
  assert asl.tiling_for(1, 4, 50, sm_count=132) == asl.Tiling(block_k=16, block_v=64, n_splits=1)


def test_kernel_that_fails_to_compile_falls_back_once(impl, monkeypatch, caplog):
  """Under auto on a 'GPU' whose compiler rejects the kernel (the CPU backend runs Pallas only in
  interpret mode), the reference is used and one warning is logged."""
  impl("auto")
  monkeypatch.setattr(asl.SWITCH, "auto_kernel", True)
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(asl.SWITCH, "probed", {})
  monkeypatch.setattr(asl.SWITCH, "warned", set())
  args = random_round(2, 3, 40, has_q=True, dtype=jnp.float32, seed=1)
  with caplog.at_level(logging.WARNING, logger=asl.__name__):
    for _ in range(2):
      got = jax.jit(asl.accept_sample)(*args)
  want = asl.accept_sample_reference(*args)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  warnings = [r for r in caplog.records if "accept_sample kernel" in r.getMessage()]
  assert len(warnings) == 1 and "XLA reference" in warnings[0].getMessage()


def test_probe_runs_inside_a_traced_loop_then_the_kernel_is_used(impl, monkeypatch):
  """Under auto on a GPU the first trace of a shape checks the kernel eagerly (inside a jitted
  fori_loop here, as in the engine's loop), records success, and the traced call uses the kernel."""
  impl("auto")
  monkeypatch.setattr(asl.SWITCH, "auto_kernel", True)
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(asl.SWITCH, "probed", {})
  calls = []
  kernel = asl.pallas_accept_sample

  def interpreted(*args, **kw):   # this CPU runs Pallas only in interpret mode
    calls.append(kw.get("tiling"))
    return kernel(*args, **{**kw, "interpret": True})

  monkeypatch.setattr(asl, "pallas_accept_sample", interpreted)
  args = random_round(2, 3, 40, has_q=False, dtype=jnp.float32, seed=2)

  def loop(*args):
    body = lambda i, acc: acc + asl.accept_sample(*args)[1]
    return jax.lax.fori_loop(0, 2, body, jnp.zeros((2,), jnp.int32))

  out = jax.jit(loop)(*args)
  assert list(asl.SWITCH.probed.values()) == [True] and len(calls) == 2       # the probe's and the traced call
  np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(asl.accept_sample_reference(*args)[1]))


@pytest.mark.parametrize("b,k,has_q,dtype", [(1, 4, False, jnp.float32), (8, 8, True, jnp.float32),
                                             (64, 16, True, jnp.bfloat16)])
def test_kernel_lowers_to_triton_for_cuda(b, k, has_q, dtype):
  """The Triton lowering (power-of-two blocks, scalar outputs, supported primitives) on the CPU via export."""
  from jax import export
  from jax._src.lib import version as jaxlib_version
  if jaxlib_version > (0, 10, 2):
    pytest.skip("newer jaxlibs compile Triton at lowering time, which needs a GPU")
  v = 49152
  sds = jax.ShapeDtypeStruct
  exp = export.export(jax.jit(asl.pallas_accept_sample), platforms=["cuda"],
                      disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
      sds((b, k + 1, v), dtype), sds((b, k), jnp.int32), sds((b,), jnp.int32), sds((b, k), jnp.float32),
      sds((b, v), jnp.float32), sds((b, k, v), dtype) if has_q else None)
  assert "xla.gpu.triton" in exp.mlir_module()
