"""Exact output law of `specjax.engine.verify.accept_drafts` (Leviathan/Chen speculative sampling).

With target distributions p_0..p_K and draft distributions q_0..q_{K-1} that do not depend on the
prefix (a valid special case of the theorem), one verification round emits a block
y_1..y_{n+1} (n = accepted drafts) whose exact law is

  n < draft_len:  prod_{i<n} min(p_i, q_i)(y_{i+1}) * max(p_n - q_n, 0)(y_{n+1})
  n = draft_len:  prod_{i<n} min(p_i, q_i)(y_{i+1}) * p_n(y_{n+1})             (bonus token)

and in particular the first emitted token is distributed as p_0. A deterministic draft (q=None)
is the case q_i = one-hot(d_i). We sample 200k rounds with independent PRNG keys (one vmapped
call) and compare with the exact law by Pearson chi-square; the same statistic, at the same
sample size and threshold, rejects deliberately wrong samplers by a wide margin, so passing is
not an accident of a weak test. (Two often-cited mistakes are *not* mistakes for this
implementation: accepting when u < p/q without min(1, .) is the same event for u in [0, 1), and
`jax.random.categorical` on log(residual) normalises the residual implicitly.)
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import chi2_gof
from specjax.engine.verify import accept_drafts

N = 200_000
P_PASS = 1e-4        # a correct sampler must not look this unlikely under its exact law
P_FAIL = 1e-12       # a wrong sampler must look at least this unlikely
TV_PASS = 0.01       # ~4x the expected TV of 200k samples on <= 8 cells


def _random_dists(rng, rows: int, v: int) -> np.ndarray:
  return rng.dirichlet(np.ones(v), size=rows).astype(np.float32)          # [rows, V]


def _draw_drafts(q: np.ndarray | None, fixed: list[int] | None, n: int, seed: int) -> jax.Array:
  """Drafts [N, K]: d_i ~ q_i independently per sample, or a fixed draft when q is None."""
  if q is None:
    return jnp.broadcast_to(jnp.asarray(fixed, jnp.int32), (n, len(fixed)))
  rng = np.random.default_rng(seed)
  q64 = q.astype(np.float64)
  cols = [rng.choice(len(qi), size=n, p=qi / qi.sum()) for qi in q64]
  return jnp.asarray(np.stack(cols, axis=1), jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def _keys(n: int, seed) -> jax.Array:
  return jax.random.key_data(jax.random.split(jax.random.key(seed), n))    # [N, 2] raw keys


@functools.partial(jax.jit, static_argnames=("use_q",))
def _run_specjax(p, q, draft, dlen, keys, use_q):
  n = draft.shape[0]
  pb = jnp.broadcast_to(p, (n,) + p.shape)
  qb = jnp.broadcast_to(q, (n,) + q.shape) if use_q else None
  return accept_drafts(pb, draft, dlen, keys, qb)


VARIANTS = ("correct", "residual_from_p", "accept_with_p", "residual_next_q")


@jax.jit
def _run_reference_jit(p, q, draft, dlen, keys, variant):
  k = draft.shape[1]

  def one(d, dl, key):
    ku, kx = jax.random.split(jax.random.wrap_key_data(key))
    u = jax.random.uniform(ku, (k,))
    pd = p[jnp.arange(k), d]
    qd = q[jnp.arange(k), d]
    ratio = jnp.where(variant == 2, pd, pd / qd)
    ok = (u < ratio) & (jnp.arange(k) < dl)
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))
    p_at = p[n_acc]
    q_idx = jnp.minimum(n_acc + jnp.where(variant == 3, 1, 0), k - 1)
    residual = jnp.where(variant == 1, p_at, jnp.maximum(p_at - q[q_idx], 0.0))
    dist = jnp.where(n_acc < dl, residual, p_at)
    return n_acc, jax.random.categorical(kx, jnp.log(dist)).astype(jnp.int32)

  return jax.vmap(one)(draft, dlen, keys)


def _run_reference(p, q, draft, dlen, keys, variant: str):
  """An independent per-row implementation of the round; `variant` injects a known mistake:
  'correct' | 'residual_from_p' (resample from p instead of max(p - q, 0)) |
  'accept_with_p' (accept with probability p(d) instead of min(1, p(d)/q(d))) |
  'residual_next_q' (off by one: residual built with the *next* position's q)."""
  return _run_reference_jit(p, q, draft, dlen, keys, jnp.int32(VARIANTS.index(variant)))


def _exact_block_law(p: np.ndarray, q: np.ndarray, dl: int) -> dict[tuple, float]:
  """{(n_acc, y_1, ..., y_{n+1}): probability} of one round with draft length dl."""
  p, q = p.astype(np.float64), q.astype(np.float64)
  v = p.shape[1]
  law = {}
  for n in range(dl + 1):
    last = np.maximum(p[n] - q[n], 0.0) if n < dl else p[n]
    for ys in itertools.product(range(v), repeat=n):
      pre = np.prod([min(p[i, y], q[i, y]) for i, y in enumerate(ys)]) if n else 1.0
      for x in range(v):
        law[(n,) + ys + (x,)] = pre * last[x]
  return law


def _block_counts(n_acc, draft, nxt, law: dict) -> np.ndarray:
  """Counts of each cell of `law` (cells ordered by n, then lexicographically by tokens, as
  `_exact_block_law` builds them: index = offset(n) + base-V value of (y_1..y_{n+1}))."""
  v = 1 + max(cell[-1] for cell in law)
  n_acc, draft, nxt = (np.asarray(x, np.int64) for x in (n_acc, draft, nxt))
  k_max = max(cell[0] for cell in law)
  offsets = np.cumsum([0] + [v ** (m + 1) for m in range(k_max + 1)])
  code = np.zeros_like(n_acc)
  for i in range(draft.shape[1]):
    code = np.where(i < n_acc, code * v + draft[:, i], code)
  code = code * v + nxt
  assert (n_acc <= k_max).all(), "more tokens accepted than drafted"
  return np.bincount(offsets[n_acc] + code, minlength=len(law)).astype(np.float64)


def _assert_no_impossible_blocks(counts, law):
  probs = np.asarray(list(law.values()))
  bad = (counts > 0) & (probs == 0)
  assert not bad.any(), f"{int(counts[bad].sum())} emitted blocks have probability 0 under the exact law"


def _first_token(n_acc, draft, nxt) -> np.ndarray:
  return np.where(np.asarray(n_acc) >= 1, np.asarray(draft)[:, 0], np.asarray(nxt))


def _first_token_stats(n_acc, draft, nxt, p0) -> tuple[float, float]:
  """(chi-square p-value, total variation) of the first emitted token against p_0."""
  y1 = _first_token(n_acc, draft, nxt)
  counts = np.bincount(y1, minlength=len(p0))
  _, _, pval = chi2_gof(counts, p0)
  return pval, 0.5 * float(np.abs(counts / counts.sum() - p0).sum())


def _case(v: int, k: int, seed: int):
  rng = np.random.default_rng(seed)
  p, q = _random_dists(rng, k + 1, v), _random_dists(rng, k, v)
  return p, q


CASES = [(5, 2, 0), (8, 2, 1), (6, 3, 2)]


@pytest.mark.parametrize("v,k,seed", CASES)
def test_first_emitted_token_is_distributed_as_p0(v, k, seed):
  """P(first emitted token = x) = p_0(x) for random p, q (V in 5..8), over 200k keys: chi-square
  p-value >= 1e-4 and total variation <= 0.01; the exact law of the whole emitted block
  (accepted count and every token) also fits. The same statistics reject three deliberately wrong
  samplers (both p-values < 1e-12 and TV > 0.01), while an independent correct reimplementation
  passes."""
  p, q = _case(v, k, seed)
  draft = _draw_drafts(q, None, N, seed=100 + seed)
  dlen = jnp.full((N,), k, jnp.int32)
  keys = _keys(N, seed=200 + seed)
  n_acc, nxt = _run_specjax(jnp.asarray(p), jnp.asarray(q), draft, dlen, keys, use_q=True)

  pval, tv = _first_token_stats(n_acc, draft, nxt, p[0])
  assert pval >= P_PASS and tv <= TV_PASS, f"first token not ~ p0: p-value {pval:.3g}, TV {tv:.4f}"
  law = _exact_block_law(p, q, k)
  counts = _block_counts(n_acc, draft, nxt, law)
  _assert_no_impossible_blocks(counts, law)
  _, df, pval_block = chi2_gof(counts, np.asarray(list(law.values())))
  assert pval_block >= P_PASS, f"emitted block does not follow the exact law: p-value {pval_block:.3g} (df {df})"

  ref = _run_reference(jnp.asarray(p), jnp.asarray(q), draft, dlen, keys, "correct")
  pval, tv = _first_token_stats(*ref[:1], draft, ref[1], p[0])
  assert pval >= P_PASS and tv <= TV_PASS, "the correct reference sampler must pass the same test"

  for variant in ("residual_from_p", "accept_with_p", "residual_next_q"):
    bad_n, bad_x = _run_reference(jnp.asarray(p), jnp.asarray(q), draft, dlen, keys, variant)
    pval, tv = _first_token_stats(bad_n, draft, bad_x, p[0])
    _, _, pval_block = chi2_gof(_block_counts(bad_n, draft, bad_x, law), np.asarray(list(law.values())))
    assert pval < P_FAIL and tv > TV_PASS and pval_block < P_FAIL, (
        f"wrong sampler {variant} was not rejected (first token p-value {pval:.3g}, TV {tv:.4f}; "
        f"block p-value {pval_block:.3g})")


@pytest.mark.parametrize("v,seed", [(5, 3), (7, 4)])
def test_deterministic_draft_q_none(v, seed):
  """q=None (a deterministic drafter, q = one-hot on the drafted token): for a fixed draft the
  first emitted token is still ~ p_0 and the block follows the exact law (accept d_i with
  probability p_i(d_i), else resample from p_i without d_i)."""
  k = 2
  rng = np.random.default_rng(seed)
  p = _random_dists(rng, k + 1, v)
  fixed = [int(np.argsort(p[0])[-2]), int(rng.integers(v))]       # second most likely, then random
  draft = _draw_drafts(None, fixed, N, seed=0)
  dlen = jnp.full((N,), k, jnp.int32)
  n_acc, nxt = _run_specjax(jnp.asarray(p), jnp.zeros((k, v), jnp.float32), draft, dlen, _keys(N, 300 + seed),
                            use_q=False)
  pval, tv = _first_token_stats(n_acc, draft, nxt, p[0])
  assert pval >= P_PASS and tv <= TV_PASS, f"first token not ~ p0: p-value {pval:.3g}, TV {tv:.4f}"
  onehot = np.eye(v, dtype=np.float32)[fixed]
  law = _exact_block_law(p, onehot, k)
  counts = _block_counts(n_acc, draft, nxt, law)
  _assert_no_impossible_blocks(counts, law)
  _, df, pval_block = chi2_gof(counts, np.asarray(list(law.values())))
  assert pval_block >= P_PASS, f"block law violated: p-value {pval_block:.3g} (df {df})"


def test_draft_len_limits_verification():
  """Rows with draft_len 0, 1 and 2 (K=2) in one batch: n_acc <= draft_len, positions past
  draft_len are never accepted, and each group's block follows the exact law for its draft
  length (draft_len 0: the token is simply ~ p_0; full acceptance: bonus ~ p_{draft_len})."""
  v, k = 6, 2
  p, q = _case(v, k, 7)
  draft = _draw_drafts(q, None, N, seed=8)
  dlen = jnp.asarray(np.arange(N) % 3, jnp.int32)
  n_acc, nxt = _run_specjax(jnp.asarray(p), jnp.asarray(q), draft, dlen, _keys(N, 9), use_q=True)
  n_acc, nxt, draft_np, dlen_np = (np.asarray(x) for x in (n_acc, nxt, draft, dlen))
  assert (n_acc <= dlen_np).all()
  for dl in range(3):
    rows = dlen_np == dl
    law = _exact_block_law(p, q, dl)
    counts = _block_counts(n_acc[rows], draft_np[rows], nxt[rows], law)
    _assert_no_impossible_blocks(counts, law)
    _, df, pval = chi2_gof(counts, np.asarray(list(law.values())))
    assert pval >= P_PASS, f"draft_len={dl}: block law violated, p-value {pval:.3g} (df {df})"


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_accepts_exactly_the_argmax_prefix(with_q):
  """One-hot p (greedy target): for every row, n_acc is the length of the longest draft prefix
  (within draft_len) that equals the target's argmax at each position, and the next token is the
  argmax after it -- whatever the key and whatever q the drafter reports."""
  n, k, v = 4096, 4, 8
  rng = np.random.default_rng(11)
  logits = rng.standard_normal((n, k + 1, v)).astype(np.float32)
  amax = logits.argmax(-1)                                                   # [N, K+1]
  p = np.eye(v, dtype=np.float32)[amax]                                      # one-hot
  hit = rng.random((n, k)) < 0.7
  draft = np.where(hit, amax[:, :k], rng.integers(0, v, (n, k))).astype(np.int32)
  dlen = rng.integers(0, k + 1, n).astype(np.int32)
  q = jnp.asarray(_random_dists(rng, n * k, v).reshape(n, k, v)) if with_q else None
  n_acc, nxt = jax.jit(accept_drafts)(jnp.asarray(p), jnp.asarray(draft), jnp.asarray(dlen), _keys(n, 12), q)
  match = draft == amax[:, :k]
  want = np.zeros(n, np.int64)
  for r in range(n):
    while want[r] < dlen[r] and match[r, want[r]]:
      want[r] += 1
  np.testing.assert_array_equal(np.asarray(n_acc), want)
  np.testing.assert_array_equal(np.asarray(nxt), amax[np.arange(n), want])
