"""The hybrid family: attention layers interleaved with gated-DeltaNet recurrent layers (Qwen3.5).

Qwen3.5's text model (transformers `Qwen3_5ForCausalLM`, model_type "qwen3_5_text"; the text part
of the "qwen3_5" multimodal checkpoints) stacks pre-norm blocks whose token mixer is either
- "linear": a gated DeltaNet (`specjax.models.gated_deltanet`), state = conv + recurrent matrix, or
- "full": gated attention: q_proj emits a query and a sigmoid output gate per head, QK-norm,
  partial rotary embedding (the first `rotary_dim` dims of each head), KV cache,
followed by a gated MLP. RMSNorms are Gemma-style (1 + w), except the DeltaNet's gated norm.

`hybrid_forward` is the pure function the engine jits, the counterpart of
`specjax.models.decoder.forward` over a `HybridState` (KV cache + recurrent states). T new tokens:
T = 1 runs the recurrent form of the DeltaNet, T > 1 (prefill, K+1-token verification) the chunked
form; both give the same result. With `return_per_step=True` it also returns the state after every
position (the `per_step` rollback); `rollback_redecode` is the other rollback.

Its configuration: `specjax.models.hybrid_config`; its weights from an HF checkpoint:
`specjax.models.hybrid_weights`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.decoder import attention_masks, params_dtype
from specjax.models.gated_deltanet import GatedDeltaNet
from specjax.models.hybrid_config import HybridConfig
from specjax.models.layers import MLP, Linear, RMSNorm, attend, grouped_layout, rope
from specjax.models.recurrent_state import ROLLBACK_MODES, HybridState, rollback_per_step, select_rows
from specjax.models.kv_cache import check_capacity


# ----------------------------------------------------------------------------------------------
# modules


def gated_qkv_layout(n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[tuple[int, ...], int]:
  """The fused layout of gated attention's q_proj (query | gate per head), k_proj, v_proj: grouped
  per KV head (`layers.grouped_layout`)."""
  return grouped_layout((2 * n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim), n_kv_heads)


class GatedAttention(nnx.Module):
  """Qwen3.5 `self_attn`: per-head query and output gate from one projection, QK-norm (1 + w),
  partial rotary embedding, sigmoid-gated output."""

  def __init__(self, cfg: HybridConfig, *, dtype, rngs: nnx.Rngs):
    h, kvh, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    # HF q_proj (per head: query | gate), k_proj and v_proj as one GEMM, columns grouped per KV head
    # (for KV head g: its H / KVH heads' query | gate, then K_g, then V_g), as `layers.qkv_layout`
    # groups plain attention: a split over the mesh's model axis keeps every group on one device.
    self.qkv_proj = Linear(cfg.d_model, (2 * h + 2 * kvh) * d, bias=cfg.attn_bias, dtype=dtype, rngs=rngs,
                           fused=gated_qkv_layout(h, kvh, d))
    self.o_proj = Linear(h * d, cfg.d_model, bias=cfg.attn_bias, dtype=dtype, rngs=rngs)
    self.q_norm = RMSNorm(d, cfg.norm_eps, offset=True, dtype=dtype)
    self.k_norm = RMSNorm(d, cfg.norm_eps, offset=True, dtype=dtype)
    self.n_heads, self.n_kv_heads, self.head_dim = h, kvh, d
    self.rotary_dim, self.theta, self.scale = cfg.rotary_dim, cfg.rope_theta, cfg.scale

  def _rope(self, x, positions):
    rd = self.rotary_dim
    return jnp.concatenate([rope(x[..., :rd], positions, self.theta), x[..., rd:]], axis=-1)

  def __call__(self, x, positions, write_kv, mask):
    """x [B, T, d_model]; positions [B, T]; write_kv(k_new, v_new) -> (k_all, v_all); mask [B, T, S]."""
    b, t, _ = x.shape
    h, kvh, d = self.n_heads, self.n_kv_heads, self.head_dim
    g = h // kvh
    qkv = self.qkv_proj(x).reshape(b, t, kvh, 2 * g + 2, d)                       # [B, T, KVH, 2G+2, D]
    qg = qkv[:, :, :, :2 * g].reshape(b, t, h, 2 * d)                             # per head: query | gate
    q, gate = qg[..., :d], qg[..., d:]                                            # [B, T, H, D] each
    k, v = qkv[:, :, :, 2 * g], qkv[:, :, :, 2 * g + 1]                           # [B, T, KVH, D]
    q, k = self._rope(self.q_norm(q), positions), self._rope(self.k_norm(k), positions)
    k_all, v_all = write_kv(k, v)                                                 # [B, S, KVH, D]
    out = attend(q, k_all, v_all, mask, self.scale) * jax.nn.sigmoid(gate)        # [B, T, H, D]
    return self.o_proj(out.reshape(b, t, h * d)), (k_all, v_all)


class HybridBlock(nnx.Module):
  def __init__(self, cfg: HybridConfig, layer: int, *, dtype, rngs: nnx.Rngs):
    self.linear = cfg.layer_types[layer] == "linear"
    self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps, offset=True, dtype=dtype)
    if self.linear:
      self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs)
    else:
      self.self_attn = GatedAttention(cfg, dtype=dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps, offset=True, dtype=dtype)
    self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

  def ffn(self, x):
    """The MLP half: x + mlp(norm(x)), x [B, T, d_model] being the stream after the token mixer."""
    return x + self.mlp(self.post_attention_layernorm(x))

  def __call__(self, x, positions, write_kv, masks):
    """A full-attention block run on its own (an MTP layer; `_run_layers` runs the target's blocks):
    x [B, T, d_model] -> (x' [B, T, d_model], (k_all, v_all)); masks as `attention_masks` makes them."""
    out, kv = self.self_attn(self.input_layernorm(x), positions, write_kv, masks["full"])
    return self.ffn(x + out), kv


class HybridLM(nnx.Module):
  def __init__(self, cfg: HybridConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.layers = nnx.List([HybridBlock(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.n_layers)])
    self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, offset=True, dtype=dtype)
    self.lm_head = (None if cfg.tie_embeddings
                    else Linear(cfg.d_model, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs))

  def logits(self, h: jax.Array) -> jax.Array:
    """Final norm + LM head. h [B, T, d_model] (pre-norm) -> [B, T, V] float32."""
    return self.head(self.norm(h))

  def head(self, h: jax.Array) -> jax.Array:
    """The LM head alone. h [B, T, d_model] (normed) -> [B, T, V] float32."""
    w = self.embed_tokens.embedding[...] if self.lm_head is None else self.lm_head.kernel[...]
    return jnp.einsum("btd,vd->btv", h.astype(w.dtype), w, preferred_element_type=jnp.float32)


@functools.lru_cache(maxsize=None)
def graphdef_of(cfg: HybridConfig, dtype_name: str):
  abstract = nnx.eval_shape(lambda: HybridLM(cfg, dtype=jnp.dtype(dtype_name), rngs=nnx.Rngs(0)))
  graphdef, _ = nnx.split(abstract)
  return graphdef


def init_params(cfg: HybridConfig, seed: int = 0, dtype=jnp.float32):
  """Random parameters (an nnx.State pytree) of `cfg`."""
  _, params = nnx.split(HybridLM(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))
  return params


def model_of(params, cfg: HybridConfig) -> HybridLM:
  return nnx.merge(graphdef_of(cfg, params_dtype(params)), params)


# ----------------------------------------------------------------------------------------------
# the forward pass


def _run_layers(model: HybridLM, cfg: HybridConfig, tokens, state: HybridState, positions, n_new, *,
                mode: str, per_step: bool, taps: Sequence[int] = (), n_layers: int | None = None):
  """Embed and run the first `n_layers` blocks.

  Returns (hidden [B, T, d_model], tapped, per attention layer K and V [B, S, KVH, D], per
  recurrent layer conv and recurrent states, per-step (conv, rec) lists (empty unless per_step))."""
  masks = attention_masks(cfg, state.lengths, positions, state.capacity)
  x = model.embed_tokens(tokens).astype(jnp.float32)                              # [B, T, d_model]
  ks, vs, conv, rec, c_steps, r_steps, tapped = [], [], [], [], [], [], []
  for i, block in enumerate(model.layers[:n_layers]):
    h = block.input_layernorm(x)
    if block.linear:
      with jax.named_scope(f"layer{i}_deltanet"):
        j = len(conv)
        out, (c, r), steps = block.linear_attn(h, state.conv[j], state.rec[j], n_new, mode=mode, per_step=per_step)
      conv.append(c)
      rec.append(r)
      if per_step:
        c_steps.append(steps[0])
        r_steps.append(steps[1])
    else:
      with jax.named_scope(f"layer{i}_attention"):
        out, (k, v) = block.self_attn(h, positions, functools.partial(state.kv.write, len(ks)), masks["full"])
      ks.append(k)
      vs.append(v)
    x = block.ffn(x + out)
    if i in taps:
      tapped.append(x)
  return x, tuple(tapped), ks, vs, conv, rec, (c_steps, r_steps)


def hybrid_forward(params, cfg: HybridConfig, tokens, state: HybridState, *, n_new=None, positions=None,
                   return_per_step: bool = False, taps: Sequence[int] = (), last_only: bool = False,
                   mode: str = "auto"):
  """Run T new tokens per sequence through the hybrid target.

  tokens [B, T] int; state.lengths [B]; n_new [B] valid new tokens (default T; padding after them
  is written to the KV cache but not committed, and leaves the recurrent state unchanged);
  positions [B, T] (default lengths + arange(T)); taps: layer indices whose outputs are returned;
  mode "auto" (T = 1: recurrent form, else chunked) | "recurrent" | "chunked".

  Returns (logits [B, T, V] float32 (or [B, 1, V] at the last valid token if last_only),
           {"prenorm": [B, T, d_model], "layers": tuple of [B, T, d_model]},
           the state after the n_new tokens (lengths += n_new),
           and with return_per_step the state after every position: a HybridState with the new KV
           cache and recurrent leaves [B, T, ...] for `rollback_per_step`).
  """
  b, t = tokens.shape
  check_capacity(state.lengths, t, state.capacity)
  if positions is None:
    positions = state.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  n_new = jnp.full((b,), t, jnp.int32) if n_new is None else jnp.asarray(n_new, jnp.int32)
  if mode == "auto":
    mode = "recurrent" if t == 1 else "chunked"
  model = model_of(params, cfg)
  x, tapped, ks, vs, conv, rec, (c_steps, r_steps) = _run_layers(
      model, cfg, tokens, state, positions, n_new, mode=mode, per_step=return_per_step, taps=tuple(taps))
  prenorm = x
  if last_only:
    x = jnp.take_along_axis(x, (n_new - 1)[:, None, None], axis=1)                # [B, 1, d_model]
  kv = dataclasses.replace(state.kv, k=tuple(ks), v=tuple(vs), lengths=state.lengths + n_new)
  new_state = HybridState(kv=kv, conv=tuple(conv), rec=tuple(rec))
  out = (model.logits(x), {"prenorm": prenorm, "layers": tapped}, new_state)
  if return_per_step:
    out = out + (HybridState(kv=kv, conv=tuple(c_steps), rec=tuple(r_steps)),)
  return out


def rollback_redecode(params, cfg: HybridConfig, state_before: HybridState, state_after: HybridState,
                      tokens, n_keep) -> HybridState:
  """The state after the first n_keep [B] of the T verified `tokens` [B, T], llama.cpp's way.

  state_before: the state verification started from (only its lengths and recurrent leaves are
  read: the checkpoint); state_after: what verification returned. If some row accepted part of
  its draft (0 < n_keep < T), the batch re-runs the verified tokens from the checkpoint with
  n_new = n_keep, through the last recurrent layer only. Rows that accepted all T tokens take
  state_after's recurrent state, rows with n_keep = 0 keep the checkpoint. The KV cache is cut to
  the accepted length (the re-run rewrites the same K/V into it: no second cache is kept).
  """
  t = tokens.shape[1]
  lengths = state_before.lengths
  n_run = cfg.linear_layers[-1] + 1                                               # layers the re-run needs

  def rerun():
    start = HybridState(kv=state_after.kv.with_lengths(lengths), conv=state_before.conv, rec=state_before.rec)
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    _, _, ks, vs, conv, rec, _ = _run_layers(model_of(params, cfg), cfg, tokens, start, positions, n_keep,
                                             mode="chunked" if t > 1 else "recurrent", per_step=False, n_layers=n_run)
    return (tuple(ks) + state_after.kv.k[len(ks):], tuple(vs) + state_after.kv.v[len(vs):],
            tuple(conv), tuple(rec))

  def keep():
    return state_after.kv.k, state_after.kv.v, state_before.conv, state_before.rec

  partial = (n_keep > 0) & (n_keep < t)
  k, v, conv, rec = jax.lax.cond(jnp.any(partial), rerun, keep)
  kv = dataclasses.replace(state_after.kv, k=k, v=v, lengths=lengths + n_keep)
  redone = HybridState(kv=kv, conv=conv, rec=rec)
  return select_rows(n_keep >= t, HybridState(kv=kv, conv=state_after.conv, rec=state_after.rec), redone)


@dataclasses.dataclass(frozen=True)
class HybridTarget:
  """Hybrid targets (`HybridConfig`), with the rollback mode of the run."""
  rollback: str = "per_step"

  def __post_init__(self):
    if self.rollback not in ROLLBACK_MODES:
      raise ValueError(f"rollback must be one of {ROLLBACK_MODES}, got {self.rollback!r}")

  def init_state(self, cfg, batch: int, capacity: int, dtype) -> HybridState:
    return HybridState.init(cfg, batch, capacity, dtype=dtype)

  def forward(self, params, cfg, tokens, state, **kw):
    return hybrid_forward(params, cfg, tokens, state, **kw)

  def verify(self, params, cfg, tokens, state, *, taps=()):
    """-> (logits, taps, state after all T tokens, per-step states (per_step) or None (redecode))."""
    if self.rollback == "per_step":
      return hybrid_forward(params, cfg, tokens, state, taps=taps, return_per_step=True)
    return hybrid_forward(params, cfg, tokens, state, taps=taps) + (None,)

  def commit(self, params, cfg, tokens, before, after, ckpt, n_keep):
    """The state after the first n_keep [B] verified tokens."""
    if self.rollback == "per_step":
      return rollback_per_step(before, ckpt, n_keep)
    return rollback_redecode(params, cfg, before, after, tokens, n_keep)


# The target's pieces for drafters (the same functions `specjax.models.decoder` gives its family).


def logits_from_prenorm(params, cfg: HybridConfig, h):
  """Target's final norm + LM head applied to pre-norm hidden states h [B, T, d_model]."""
  return model_of(params, cfg).logits(h)


def final_norm(params, cfg: HybridConfig, h):
  """Target's final norm alone. h [B, T, d_model] -> [B, T, d_model]."""
  return model_of(params, cfg).norm(h)


def lm_head_logits(params, cfg: HybridConfig, h):
  """Target's LM head alone (no final norm) on h [B, T, d_model] -> [B, T, V] float32."""
  return model_of(params, cfg).head(h)


def embed_tokens(params, cfg: HybridConfig, tokens):
  """Target's token embedding. tokens [B, T] -> [B, T, d_model] float32."""
  return model_of(params, cfg).embed_tokens(tokens).astype(jnp.float32)
