"""Verification of drafts against the target: lossless speculative sampling.

One function serves greedy and sampling: with temperature 0 the target distribution `p` is
one-hot on its argmax, so "accept with probability min(1, p/q)" is "accept iff the draft is the
argmax" and the residual resample is the argmax itself. Deterministic drafters pass no `q`
(one-hot on the drafted token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.kernels.accept_sample import accept_sample


def accept_drafts(p: jax.Array, draft: jax.Array, draft_len: jax.Array, keys: jax.Array,
                  q: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Leviathan/Chen rejection sampling over a chain draft.

  p [B, K+1, V] shaped target distributions at [last, d1..dK]; draft [B, K] int; draft_len [B]
  (positions >= draft_len are ignored); keys [B, 2] per-sequence PRNG keys; q [B, K, V] draft
  distributions or None for deterministic drafts.

  Returns (n_accepted [B] in [0, draft_len], next_token [B]): the token sampled after the
  accepted prefix (residual resample on rejection, bonus from p when all were accepted).

  The uniforms and the Gumbel noise are drawn here from the keys; the step itself is
  `specjax.kernels.accept_sample` (a Pallas kernel on a GPU, its XLA reference elsewhere).
  """
  b, k1, v = p.shape
  k = k1 - 1
  subkeys = jax.vmap(lambda key: jax.random.key_data(
      jax.random.split(jax.random.wrap_key_data(key), 2)))(keys)                   # [B, 2, 2]
  u = jax.vmap(lambda key: jax.random.uniform(jax.random.wrap_key_data(key), (k,)))(subkeys[:, 0])  # [B, K]
  # the noise `jax.random.categorical(subkey, log dist)` would draw: the next token is the Gumbel-max
  gumbel = jax.vmap(lambda key: jax.random.gumbel(jax.random.wrap_key_data(key), (v,), jnp.float32))(
      subkeys[:, 1])                                                               # [B, V]
  return accept_sample(p, draft, draft_len, u, gumbel, q)
