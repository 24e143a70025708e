"""The decoder-only transformer of every attention family (llama, qwen2, gemma3), and `forward`.

The families differ by configuration flags only (QKV bias, QK-norm, sandwich norms, embedding
scaling, sliding-window layers, tied head), so one module covers them all rather than three
near-copies. `forward` is the pure function the engine jits: the NNX graph is split once per
config, and merged inside the trace.

One `forward` serves prefill, one-token decode, K+1-token verification and tree verification:
T new tokens per sequence are written at cache slots `length .. length+T-1`, at rotary positions
`positions` (default: the slots), and see every committed slot plus the new tokens allowed by
`attn_mask` (default: causal among the new tokens).

With `cfg.invariant` every matmul, norm and attention runs through the batch-invariant kernels
(`specjax.models.layers`): a position's K/V and logits are then bitwise the same whether it is
prefilled, decoded alone or verified inside a chain or a tree, so speculative greedy output equals
plain greedy output in bf16 too.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.kernels import invariant_matmul
from specjax.kernels.verify_attention import RaggedMask, causal_new_mask
from specjax.models.config import ModelConfig
from specjax.models.layers import MLP, Attention, Linear, RMSNorm
from specjax.models.kv_cache import KVCache, check_capacity


class Block(nnx.Module):
  """One decoder layer. `invariant` (the target's `cfg.invariant`, passed by `Transformer`; heads
  that reuse the block keep the XLA path) selects the batch-invariant kernels."""

  def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs, invariant: bool = False):
    self.sliding = cfg.layer_types[layer] == "sliding"
    norm = lambda: RMSNorm(cfg.d_model, cfg.norm_eps, offset=cfg.norm_offset, dtype=dtype, invariant=invariant)
    self.input_layernorm = norm()
    self.self_attn = Attention(cfg, sliding=self.sliding, dtype=dtype, rngs=rngs, invariant=invariant)
    self.post_attention_layernorm = norm()
    self.mlp = MLP(cfg, dtype=dtype, rngs=rngs, invariant=invariant)
    if cfg.sandwich_norm:
      self.pre_feedforward_layernorm = norm()
      self.post_feedforward_layernorm = norm()
    self.sandwich = cfg.sandwich_norm
    self.invariant = invariant

  def __call__(self, x, positions, write_kv, masks):
    kind = "sliding" if self.sliding else "full"
    if self.invariant:   # the full-attention ragged mask; a sliding window is applied in the kernel
      ragged, causal = masks["ragged"]["full"], masks["causal"]
    else:
      ragged, causal = masks.get("ragged", {}).get(kind), False
    attn_out, kv = self.self_attn(self.input_layernorm(x), positions, write_kv, masks[kind], ragged, causal)
    if self.sandwich:   # gemma3: norm the attention output, then a pre-norm and post-norm around the MLP
      x = x + self.post_attention_layernorm(attn_out)
      x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
    else:
      x = x + attn_out
      x = x + self.mlp(self.post_attention_layernorm(x))
    return x, kv


class Transformer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.cfg = cfg
    inv = cfg.invariant
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.layers = nnx.List([Block(cfg, i, dtype=dtype, rngs=rngs, invariant=inv) for i in range(cfg.n_layers)])
    self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, offset=cfg.norm_offset, dtype=dtype, invariant=inv)
    self.lm_head = None if cfg.tie_embeddings else Linear(cfg.d_model, cfg.vocab_size, bias=False, dtype=dtype,
                                                          rngs=rngs, invariant=inv)

  def embed(self, tokens: jax.Array) -> jax.Array:
    x = self.embed_tokens(tokens)                                                # [B, T, d_model]
    if self.cfg.embed_scale:   # Gemma scales in the weight dtype (the normalizer is rounded to it)
      x = x * jnp.asarray(self.cfg.d_model ** 0.5, x.dtype)
    return x.astype(jnp.float32)                                                 # float32 residual stream

  def logits(self, h: jax.Array) -> jax.Array:
    """Final norm + LM head. h [B, T, d_model] (pre-norm) -> [B, T, V] float32."""
    return self.head(self.norm(h))

  def head(self, h: jax.Array) -> jax.Array:
    """The LM head alone. h [B, T, d_model] (normed) -> [B, T, V] float32."""
    w = self.embed_tokens.embedding[...] if self.lm_head is None else self.lm_head.kernel[...]   # [V, d]
    if self.cfg.invariant:     # a row's logits summed alike whatever the rows beside it
      return invariant_matmul.pallas_matmul(h, w, transposed=True)                  # [B, T, V]
    return jnp.einsum("btd,vd->btv", h.astype(w.dtype), w, preferred_element_type=jnp.float32)

  def __call__(self, tokens, cache: KVCache, positions, masks, *, taps: Sequence[int] = (), last_only=None):
    x = self.embed(tokens)
    new_k, new_v, tapped = [], [], []
    for i, block in enumerate(self.layers):
      write = functools.partial(cache.write, i)
      x, (k, v) = block(x, positions, write, masks)
      new_k.append(k)
      new_v.append(v)
      if i in taps:
        tapped.append(x)
    prenorm = x
    if last_only is not None:   # [B] index of the token whose logits are wanted
      x = jnp.take_along_axis(x, last_only[:, None, None], axis=1)               # [B, 1, d_model]
    return self.logits(x), prenorm, tuple(tapped), (tuple(new_k), tuple(new_v))


def attention_masks(cfg: ModelConfig, lengths, positions, capacity: int, attn_mask=None):
  """Visibility masks [B, T, S] for full and sliding layers, and under "ragged" the same masks as
  `RaggedMask`s (lengths + the mask among the new tokens) for the verification-attention kernel
  (None for sliding-window layers, which stay on the dense mask); "causal": no `attn_mask` was
  given (static; the batch-invariant attention reads chains straight from their slots).

  lengths [B] committed slots; positions [B, T] rotary positions of the new tokens;
  attn_mask [B, T, T] bool among the new tokens (default causal).
  """
  b, t = positions.shape
  slot = jnp.arange(capacity, dtype=jnp.int32)[None, :]                          # [1, S]
  rel = slot - lengths[:, None]                                                  # [B, S] index among new tokens
  committed = rel < 0                                                            # [B, S]
  is_new = (rel >= 0) & (rel < t)
  rel_c = jnp.clip(rel, 0, t - 1)
  if attn_mask is None:
    new_visible = rel_c[:, None, :] <= jnp.arange(t)[None, :, None]              # [B, T, S]
  else:
    new_visible = jnp.take_along_axis(attn_mask, jnp.broadcast_to(rel_c[:, None, :], (b, t, capacity)), axis=2)
  full = committed[:, None, :] | (is_new[:, None, :] & new_visible)             # [B, T, S]
  masks = {"full": full}
  if cfg.sliding_window:
    key_pos = jnp.where(is_new, jnp.take_along_axis(positions, rel_c, axis=1), slot)   # [B, S]
    near = (positions[:, :, None] - key_pos[:, None, :]) < cfg.sliding_window
    masks["sliding"] = full & near
  else:
    masks["sliding"] = full
  ragged = RaggedMask(lengths, causal_new_mask(b, t) if attn_mask is None else attn_mask)
  masks["ragged"] = {"full": ragged, "sliding": None if cfg.sliding_window else ragged}
  masks["causal"] = attn_mask is None
  return masks


@functools.lru_cache(maxsize=None)
def graphdef_of(cfg: ModelConfig, dtype_name: str):
  """The NNX graph definition of a config, built once (abstractly: no weights allocated)."""
  dtype = jnp.dtype(dtype_name)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
  graphdef, _ = nnx.split(abstract)
  return graphdef


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32):
  """Random parameters (an nnx.State pytree) of `cfg`."""
  model = Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
  _, params = nnx.split(model)
  return params


def params_dtype(params) -> str:
  return str(jax.tree_util.tree_leaves(params)[0].dtype)


def model_of(params, cfg: ModelConfig) -> Transformer:
  return nnx.merge(graphdef_of(cfg, params_dtype(params)), params)


def forward(params, cfg: ModelConfig, tokens, cache: KVCache, *, positions=None, n_new=None,
            attn_mask=None, taps: Sequence[int] = (), last_only: bool = False):
  """Run T new tokens per sequence through the target.

  tokens [B, T] int; cache.lengths [B]; positions [B, T] (default lengths + arange(T));
  n_new [B] valid new tokens per sequence (default T; padding after them is written but not
  committed); attn_mask [B, T, T] bool among the new tokens (trees); taps: layer indices whose
  output hidden states are returned.

  Returns (logits [B, T, V] float32 (or [B, 1, V] at the last valid token if last_only),
           {"prenorm": [B, T, d_model], "layers": tuple of [B, T, d_model]},
           cache with the new K/V written and lengths += n_new).
  """
  b, t = tokens.shape
  check_capacity(cache.lengths, t, cache.capacity)
  if positions is None:
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  n_new = jnp.full((b,), t, jnp.int32) if n_new is None else jnp.asarray(n_new, jnp.int32)
  masks = attention_masks(cfg, cache.lengths, positions, cache.capacity, attn_mask)
  model = model_of(params, cfg)
  last = n_new - 1 if last_only else None
  logits, prenorm, tapped, (k, v) = model(tokens, cache, positions, masks, taps=tuple(taps), last_only=last)
  new_cache = KVCache(k=k, v=v, lengths=cache.lengths + n_new)
  return logits, {"prenorm": prenorm, "layers": tapped}, new_cache


@dataclasses.dataclass(frozen=True)
class DecoderTarget:
  """How the engine runs an attention-only target: the KV cache is its whole state, and rolling
  back a rejected draft is setting the lengths (see `specjax.models.hybrid.HybridTarget`)."""

  def init_state(self, cfg: ModelConfig, batch: int, capacity: int, dtype) -> KVCache:
    return KVCache.init(cfg, batch, capacity, dtype=dtype)

  def forward(self, params, cfg: ModelConfig, tokens, state: KVCache, **kw):
    return forward(params, cfg, tokens, state, **kw)

  def verify(self, params, cfg: ModelConfig, tokens, state: KVCache, *, taps=()):
    """-> (logits, taps, cache with all T tokens written, checkpoint: none needed)."""
    return forward(params, cfg, tokens, state, taps=taps) + (None,)

  def commit(self, params, cfg: ModelConfig, tokens, before: KVCache, after: KVCache, ckpt, n_keep) -> KVCache:
    """The cache after the first n_keep [B] verified tokens: rollback by length."""
    return after.with_lengths(before.lengths + n_keep)


# The target's pieces for drafters and head training. They run the XLA path even for an invariant
# target: a draft needs no bitwise agreement with verification (the target's own `forward` decides
# what is emitted), and the batch-invariant kernels would only slow drafting down. They read only
# the embedding, final norm and LM head, so a drafter passes the checkpoint's config even for a
# target padded with zero KV groups for a mesh (`parallel.pad_heads`): the attention layers the
# merged module declares with fewer heads are never called.


def _drafting_model(params, cfg: ModelConfig) -> Transformer:
  return model_of(params, cfg.replace(invariant=False) if cfg.invariant else cfg)


def logits_from_prenorm(params, cfg: ModelConfig, h):
  """Target's final norm + LM head applied to pre-norm hidden states h [B, T, d_model]."""
  return _drafting_model(params, cfg).logits(h)


def final_norm(params, cfg: ModelConfig, h):
  """Target's final norm alone. h [B, T, d_model] -> [B, T, d_model]."""
  return _drafting_model(params, cfg).norm(h)


def lm_head_logits(params, cfg: ModelConfig, h):
  """Target's LM head alone (no final norm) on h [B, T, d_model] -> [B, T, V] float32."""
  return _drafting_model(params, cfg).head(h)


def embed_tokens(params, cfg: ModelConfig, tokens):
  """Target's (scaled) token embedding. tokens [B, T] -> [B, T, d_model]."""
  return _drafting_model(params, cfg).embed(tokens)
