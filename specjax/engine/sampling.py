"""Sampling parameters (per sequence), sampler state, and logits shaping.

Every parameter is an array indexed by sequence, so one batch can mix greedy and sampled
sequences with different temperatures, top-k, top-p and seeds. Greedy (temperature 0) is the
one-hot distribution on the argmax, so the same rejection sampler serves greedy and sampling.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import UserError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: jax.Array     # [B] float32; 0 = greedy
  top_k: jax.Array           # [B] int32; 0 = off
  top_p: jax.Array           # [B] float32; 1 = off
  seed: jax.Array            # [B] uint32

  @staticmethod
  def make(batch: int, temperature=0.0, top_k=0, top_p=1.0, seed=0) -> "SamplingParams":
    """Broadcast scalars or per-sequence lists to [B] arrays; check their ranges."""
    return SamplingParams(*map(jnp.asarray, SamplingParams.host(batch, temperature, top_k, top_p, seed)))

  @staticmethod
  def host(batch: int, temperature=0.0, top_k=0, top_p=1.0, seed=0) -> tuple[np.ndarray, ...]:
    """`make`'s checked [B] arrays on the host: (temperature f32, top_k i32, top_p f32, seed u32)."""
    def arr(x, dt, name):
      a = np.asarray(x, dt)
      if a.size not in (1, batch):
        raise UserError(f"{name} has {a.size} values for {batch} sequence(s): give one, or one per sequence")
      return np.broadcast_to(a.reshape(-1) if a.size == batch else a.reshape(()), (batch,)).copy()
    t, k, p, s = (arr(temperature, np.float32, "temperature"), arr(top_k, np.int32, "top_k"),
                  arr(top_p, np.float32, "top_p"), arr(seed, np.int64, "seed"))
    if not (np.isfinite(t) & (t >= 0)).all():
      raise UserError(f"temperature must be a finite number >= 0, got {t}")
    if (k < 0).any():
      raise UserError(f"top_k must be >= 0 (0 = off), got {k}")
    if not ((p > 0) & (p <= 1)).all():          # NaN fails both comparisons
      raise UserError(f"top_p must be in (0, 1], got {p}")
    if batch > 1 and np.ndim(seed) == 0:
      s = s + np.arange(batch)   # distinct streams per sequence unless seeds are given per sequence
    return t, k, p, s.astype(np.uint32)

  @property
  def greedy(self) -> jax.Array:
    return self.temperature <= 0.0


def init_keys(params: SamplingParams) -> jax.Array:
  """Per-sequence raw PRNG keys [B, 2] uint32: the sampler state."""
  return jax.vmap(lambda s: jax.random.key_data(jax.random.key(s)))(params.seed)


def split_keys(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(next state, keys to use now), both [B, 2]."""
  both = jax.vmap(lambda k: jax.random.key_data(jax.random.split(jax.random.wrap_key_data(k))))(keys)
  return both[:, 0], both[:, 1]


def _filter_logits(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Mask z [B, T, V] to the top-k and nucleus top-p sets of each row (per-sequence k, p)."""
  v = z.shape[-1]
  srt = -jnp.sort(-z, axis=-1)                                                  # [B, T, V] descending
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)[:, None, None]             # [B, 1, 1]
  kth = jnp.take_along_axis(srt, jnp.broadcast_to(k - 1, srt.shape[:-1] + (1,)), axis=-1)
  ps = jax.nn.softmax(jnp.where(jnp.arange(v) < k, srt, -jnp.inf), axis=-1)   # nucleus within the top-k
  before = jnp.cumsum(ps, axis=-1) - ps                                         # mass strictly above
  keep_sorted = before < top_p[:, None, None]
  n_keep = jnp.sum(keep_sorted, axis=-1, keepdims=True)                         # >= 1
  pth = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
  return jnp.where((z >= kth) & (z >= pth), z, -jnp.inf)


def shaped_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Target (or draft) distribution after temperature, top-k and top-p. logits [B, T, V] -> [B, T, V].

  Greedy rows become one-hot on the argmax (lowest index on ties).
  """
  logits = logits.astype(jnp.float32)
  temp = jnp.where(params.greedy, 1.0, params.temperature)[:, None, None]
  z = logits / temp
  needs_filter = jnp.any(((params.top_k > 0) | (params.top_p < 1.0)) & ~params.greedy)
  z = jax.lax.cond(needs_filter, _filter_logits, lambda z, k, p: z, z, params.top_k, params.top_p)
  probs = jax.nn.softmax(z, axis=-1)
  onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  return jnp.where(params.greedy[:, None, None], onehot, probs)


def next_token(logits: jax.Array, params: SamplingParams, keys: jax.Array) -> jax.Array:
  """One token per row of logits [B, V] -> [B] int32: the argmax for greedy rows (lowest index on
  ties), else a draw from the row's shaped distribution (`shaped_probs`) with its key [B, 2]. The
  tokens `sample(shaped_probs(...))` gives (a greedy row's one-hot draws its argmax); when every row
  is greedy only the argmax runs, since the softmax and the random draws cost a greedy step kernels
  (and, over a vocabulary split across devices, collectives) it does not need."""
  def draw(logits):
    return sample(shaped_probs(logits[:, None], params)[:, 0], keys)

  def argmax(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.lax.cond(jnp.all(params.greedy), argmax, draw, logits)


def sample(probs: jax.Array, keys: jax.Array) -> jax.Array:
  """One token per row of probs [B, V] with per-sequence keys [B, 2] -> [B] int32."""
  def one(p, k):
    return jax.random.categorical(jax.random.wrap_key_data(k), jnp.log(p))
  return jax.vmap(one)(probs, keys).astype(jnp.int32)
