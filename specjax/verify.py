"""Verification of drafts against the target: lossless speculative sampling.

One function serves greedy and sampling: with temperature 0 the target distribution `p` is
one-hot on its argmax, so "accept with probability min(1, p/q)" is "accept iff the draft is the
argmax" and the residual resample is the argmax itself. Deterministic drafters pass no `q`
(one-hot on the drafted token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accept_drafts(p: jax.Array, draft: jax.Array, draft_len: jax.Array, keys: jax.Array,
                  q: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Leviathan/Chen rejection sampling over a chain draft.

  p [B, K+1, V] shaped target distributions at [last, d1..dK]; draft [B, K] int; draft_len [B]
  (positions >= draft_len are ignored); keys [B, 2] per-sequence PRNG keys; q [B, K, V] draft
  distributions or None for deterministic drafts.

  Returns (n_accepted [B] in [0, draft_len], next_token [B]): the token sampled after the
  accepted prefix (residual resample on rejection, bonus from p when all were accepted).
  """
  b, k1, v = p.shape
  k = k1 - 1
  subkeys = jax.vmap(lambda key: jax.random.key_data(
      jax.random.split(jax.random.wrap_key_data(key), 2)))(keys)                   # [B, 2, 2]
  u = jax.vmap(lambda key: jax.random.uniform(jax.random.wrap_key_data(key), (k,)))(subkeys[:, 0])  # [B, K]
  p_draft = jnp.take_along_axis(p[:, :k], draft[..., None], axis=-1)[..., 0]        # [B, K] p(d_i)
  if q is None:
    q_draft = jnp.ones_like(p_draft)
  else:
    q_draft = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]           # [B, K]
  ok = (u * q_draft < p_draft) & (jnp.arange(k)[None, :] < draft_len[:, None])     # [B, K]
  n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1)            # [B]

  p_at = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]                # [B, V]
  rejected = n_acc < draft_len                                                     # [B]
  if k > 0:
    idx = jnp.minimum(n_acc, k - 1)
    if q is None:
      d_at = jnp.take_along_axis(draft, idx[:, None], axis=1)[:, 0]
      q_at = jax.nn.one_hot(d_at, v, dtype=p.dtype)                                 # [B, V]
    else:
      q_at = jnp.take_along_axis(q, idx[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_at - q_at, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_at)
    dist = jnp.where(rejected[:, None], residual, p_at)
  else:
    dist = p_at
  next_token = jax.vmap(lambda pr, key: jax.random.categorical(jax.random.wrap_key_data(key), jnp.log(pr)))(
      dist, subkeys[:, 1]).astype(jnp.int32)
  return n_acc, next_token
