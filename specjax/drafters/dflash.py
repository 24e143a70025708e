"""`dflash`: block-diffusion drafting conditioned on target features (z-lab DFlash), one forward
pass per draft.

The drafter. Outputs of a few target layers spread over its depth (`taps`) are concatenated per
position and fused by `fc` + RMSNorm into one context feature per position. A few decoder layers
of the target's family then read a block `[last, MASK x (B-1)]` at positions t .. t+B-1 (t = the
position of `last`, the target's cache length): in every layer the keys and values are the
layer's own K/V projections of the context features (positions < t) followed by those of the
block ("KV injection"), and the block attends to all of it, non-causally. The target's final norm
and LM head turn block slot k into a distribution for the token at t + k (k = 1 .. B-1): B-1
drafts from one pass. Token embeddings and the LM head are the target's (shared, frozen); the
MASK embedding is learned.

z-lab's variant (`DFlashConfig.mask_token_id`, `final_norm`, `layer_fields`; see
`specjax/drafters/dflash_reference.py`): the MASK embedding is the target's embedding of token
`mask_token_id` (no learned vector), the drafter's own final RMSNorm replaces the target's before
the target's LM head, and the layers are Qwen3 layers of their own sizes whatever the target.

Context. Each sequence keeps the fused features of its last `window` committed positions in a
`FeatureWindow` (`specjax/drafters/feature_window.py`): `init` writes the prompt's, `commit` the
accepted tokens' (the rows of [last, d1..dn] from the verification pass, positions t .. t+n),
never a rejected token's; the new `last` is the next anchor, so the context is always exactly the
committed positions < t, bounded by the window. Training (`specjax/train/dflash.py`) uses the
same visibility: an anchor at t sees positions [t - window, t) and its own block.

Sampling. The drafts of a sequence are drawn from its per-position distributions q (temperature
of the sequence; greedy = one-hot on the argmax) with the drafter's own per-sequence PRNG keys,
and q goes to verification: lossless rejection sampling for any q.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters.base import DeviceDrafter, Draft, DraftContext, RoundResult
from specjax.drafters import head_file
from specjax.drafters.head_file import (abstract_params, check_target, fused_sizes, graphdef_of, params_of,
                                        params_from_tensors, refuse_unplaced, tensors_from)
from specjax.drafters.feature_window import FeatureWindow
from specjax.errors import UserError
from specjax.models.config import ModelConfig
from specjax.models.decoder import Block, embed_tokens, lm_head_logits, logits_from_prenorm
from specjax.models.layers import Linear, RMSNorm, rope
from specjax.models.weights import hf_names
from specjax.engine.sampling import SamplingParams, shaped_probs, split_keys

FORMAT = "specjax-dflash-v1"


def spread_taps(n_target_layers: int, n_taps: int) -> tuple[int, ...]:
  """`n_taps` target layers evenly spaced from layer 1 to layer N-3 (DFlash's choice), clamped to
  the layers a small target has."""
  last = n_target_layers - 1
  lo, hi = min(1, last), max(min(1, last), n_target_layers - 3)
  if n_taps == 1:
    return ((lo + hi) // 2,)
  return tuple(sorted({int(round(lo + i * (hi - lo) / (n_taps - 1))) for i in range(n_taps)}))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  taps: tuple[int, ...]              # target layers whose outputs are fused (ascending)
  n_layers: int = 2                  # drafter decoder layers
  block_size: int = 16               # B: [last, MASK x (B-1)], B-1 drafts per pass
  window: int = 256                  # context positions kept per sequence
  ffn_dim: int | None = None         # MLP width of the drafter's layers (default: the target's)
  mask_token_id: int | None = None   # None: a learned MASK embedding; else the target's embedding of this token
  final_norm: bool = False           # the drafter's own final RMSNorm before the LM head (else the target's)
  layer_fields: tuple = ()           # (ModelConfig field, value) pairs overriding the target's for the layers

  def __post_init__(self):
    object.__setattr__(self, "taps", tuple(int(t) for t in self.taps))
    object.__setattr__(self, "layer_fields", tuple(
        (str(k), tuple(v) if isinstance(v, list) else v) for k, v in self.layer_fields))
    if list(self.taps) != sorted(set(self.taps)) or not self.taps:
      raise ValueError(f"taps must be distinct ascending layer indices, got {self.taps}")
    if self.block_size < 2 or self.window < 1 or self.n_layers < 1:
      raise ValueError(f"need block_size >= 2, window >= 1, n_layers >= 1: {self}")


def layer_config(cfg: ModelConfig, dc: DFlashConfig) -> ModelConfig:
  """The drafter layers: the target's family and widths, full attention."""
  return cfg.replace(n_layers=dc.n_layers, layer_types=("full",) * dc.n_layers, sliding_window=None,
                     ffn_dim=dc.ffn_dim or cfg.ffn_dim, **dict(dc.layer_fields))


class DFlashModel(nnx.Module):
  """fc [n_taps * D -> D] + hidden_norm (the context features), a learned MASK embedding (unless
  `mask_token_id`), `n_layers` decoder blocks with KV injection, and a final norm (`final_norm`)."""

  def __init__(self, cfg: ModelConfig, dc: DFlashConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    d = cfg.d_model
    lc = layer_config(cfg, dc)
    self.fc = Linear(len(dc.taps) * d, d, bias=False, dtype=dtype, rngs=rngs)
    self.hidden_norm = RMSNorm(d, lc.norm_eps, offset=lc.norm_offset, dtype=dtype)
    if dc.mask_token_id is None:
      self.mask_embedding = nnx.Param(jax.random.normal(rngs.params(), (d,), jnp.float32).astype(dtype))
    if dc.final_norm:
      self.norm = RMSNorm(d, lc.norm_eps, offset=lc.norm_offset, dtype=dtype)
    self.layers = nnx.List([Block(lc, i, dtype=dtype, rngs=rngs) for i in range(dc.n_layers)])

  def fuse(self, taps: jax.Array) -> jax.Array:
    """Concatenated target taps [B, T, n_taps * D] -> context features [B, T, D]."""
    return self.hidden_norm(self.fc(taps))

  def __call__(self, x, positions, ctx, ctx_pos, mask):
    """x [B, T, D] block inputs at rotary positions [B, T]; ctx [B, S, D] context features at
    ctx_pos [B, S]; mask [B, T, S + T] (True = visible). Returns the block's hidden [B, T, D]."""
    for layer in self.layers:
      k_ctx, v_ctx = _context_kv(layer.self_attn, ctx, ctx_pos)
      write = lambda k, v, kc=k_ctx, vc=v_ctx: (jnp.concatenate([kc, k.astype(kc.dtype)], axis=1),
                                                jnp.concatenate([vc, v.astype(vc.dtype)], axis=1))
      x, _ = layer(x, positions, write, {"full": mask, "sliding": mask})
    return x


def _context_kv(attn, ctx, ctx_pos):
  """A layer's keys and values of the context features: its own K/V projections (no input norm:
  the features are normed by hidden_norm), k-norm and rotary as for its tokens. -> [B, S, KVH, hd] x2."""
  b, s, _ = ctx.shape
  kvh, hd = attn.n_kv_heads, attn.head_dim
  g = attn.n_heads // kvh
  # the K and V rows of the fused projection: per KV head, the two after its g query heads
  kv_rows = lambda x: x.reshape(kvh, g + 2, hd, *x.shape[1:])[:, g:].reshape(-1, *x.shape[1:])
  w = kv_rows(attn.qkv_proj.kernel[...])                                          # [KVH * 2 * hd, D]
  kv = jnp.einsum("bsd,od->bso", ctx.astype(w.dtype), w, preferred_element_type=jnp.float32)
  if attn.qkv_proj.bias is not None:
    kv = kv + kv_rows(attn.qkv_proj.bias[...]).astype(jnp.float32)
  kv = kv.reshape(b, s, kvh, 2, hd)
  k, v = kv[:, :, :, 0], kv[:, :, :, 1]                                          # [B, S, KVH, hd]
  if attn.k_norm is not None:
    k = attn.k_norm(k)
  return rope(k, ctx_pos, attn.theta, attn.rope_scaling), v


@functools.lru_cache(maxsize=None)
def model_graphdef(cfg: ModelConfig, dc: DFlashConfig, dtype_name: str):
  return graphdef_of(lambda: DFlashModel(cfg, dc, dtype=jnp.dtype(dtype_name), rngs=nnx.Rngs(0)))


def model_of(dparams, cfg: ModelConfig, dc: DFlashConfig) -> DFlashModel:
  return nnx.merge(model_graphdef(cfg, dc, str(jax.tree_util.tree_leaves(dparams)[0].dtype)), dparams)


def init_dflash(cfg: ModelConfig, dc: DFlashConfig, seed: int = 0, dtype=jnp.float32, target_params=None) -> dict:
  """Drafter parameters (a pure dict). Matrices N(0, 1/d_in), except each layer's output
  projections (o_proj, down_proj), which start at zero: the residual branches start silent, so the
  first logits are the LM head's on the block embeddings, not noise of large norm. The MASK
  embedding is N(0, 1) scaled to the RMS of the target's token embeddings when those are given; an
  own final norm starts as the target's."""
  pure = params_of(DFlashModel(cfg, dc, dtype=dtype, rngs=nnx.Rngs(seed)))
  for layer in pure["layers"].values():
    for proj in (layer["self_attn"]["o_proj"], layer["mlp"]["down_proj"]):
      proj["kernel"] = jnp.zeros_like(proj["kernel"])
  if target_params is not None and dc.final_norm:
    w = jnp.asarray(nnx.to_pure_dict(target_params)["norm"]["weight"], jnp.float32)
    own_offset = layer_config(cfg, dc).norm_offset
    pure["norm"]["weight"] = (w + (1.0 if cfg.norm_offset and not own_offset else 0.0)).astype(dtype)
  if target_params is not None and dc.mask_token_id is None:
    emb = nnx.to_pure_dict(target_params)["embed_tokens"]["embedding"]
    rms = jnp.sqrt(jnp.mean(jnp.square(jnp.asarray(emb, jnp.float32))))
    pure["mask_embedding"] = (pure["mask_embedding"].astype(jnp.float32) * rms).astype(dtype)
  return pure


def concat_taps(layer_taps) -> jax.Array:
  """Tuple of per-layer taps [B, T, D] -> [B, T, n_taps * D]."""
  return jnp.concatenate([t.astype(jnp.float32) for t in layer_taps], axis=-1)


def block_inputs(dparams, tparams, cfg: ModelConfig, dc: DFlashConfig, anchors) -> jax.Array:
  """Block embeddings [..., B, D] for anchor tokens [...]: the target's embedding of the anchor,
  then the MASK embedding B-1 times (learned, or the target's embedding of mask_token_id)."""
  emb = embed_tokens(tparams, cfg, anchors.reshape(-1, 1)).reshape(anchors.shape + (1, cfg.d_model))
  if dc.mask_token_id is None:
    mask_vec = dparams["mask_embedding"].astype(jnp.float32)                       # [D]
  else:
    mask_vec = embed_tokens(tparams, cfg, jnp.full((1, 1), dc.mask_token_id, jnp.int32))[0, 0]   # [D]
  mask = jnp.broadcast_to(mask_vec, anchors.shape + (dc.block_size - 1, cfg.d_model))
  return jnp.concatenate([emb, mask], axis=-2)


def draft_logits(dparams, tparams, cfg: ModelConfig, dc: DFlashConfig, h) -> jax.Array:
  """Logits [..., T, V] of the drafter's hidden states h [..., T, D]: the target's final norm and LM
  head, or (final_norm) the drafter's own norm and the target's LM head alone."""
  if not dc.final_norm:
    return logits_from_prenorm(tparams, cfg, h)
  return lm_head_logits(tparams, cfg, model_of(dparams, cfg, dc).norm(h))


# ----------------------------------------------------------------------------------------------
# the drafter


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlashState:
  window: FeatureWindow           # fused context features of the last `window` committed positions
  keys: jax.Array                 # [B, 2] uint32: the drafter's sampler state
  base: jax.Array                 # [B] target_len when the current draft was made (position of `last`)


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(DeviceDrafter):
  """Device drafter over a DFlash model. `weights` = {"dflash": drafter params, "target": the
  target's params}; hashable by static config only."""
  chunk_commit = True            # commit appends the verified positions' features (adaptive width 0: plain chunks)
  cfg: ModelConfig                # the target's config
  dc: DFlashConfig
  max_draft: int = 15             # drafts used per pass (<= block_size - 1)
  weights: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
  seed: int = 0                   # of the drafter's own sampling keys
  name: str = "dflash"

  def __post_init__(self):
    if not 1 <= self.max_draft <= self.dc.block_size - 1:
      raise ValueError(f"max_draft must be in [1, block_size - 1 = {self.dc.block_size - 1}], got {self.max_draft}")

  @property
  def taps(self) -> tuple[int, ...]:
    return self.dc.taps

  def params(self):
    return self.weights

  def fuse(self, dparams, layer_taps):
    return model_of(dparams["dflash"], self.cfg, self.dc).fuse(concat_taps(layer_taps))

  def init(self, dparams, prompt_tokens, prompt_lens, prefill_taps, capacity: int) -> DFlashState:
    """The window holds the prompt's last `window` positions; `last` (position prompt_len) is the
    first anchor."""
    b, t = prompt_tokens.shape
    feats = self.fuse(dparams, prefill_taps["layers"])                             # [B, T, D]
    dtype = jax.tree_util.tree_leaves(dparams["dflash"])[0].dtype
    window = FeatureWindow.empty(b, self.dc.window, self.cfg.d_model, dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    window = window.append(feats, positions, prompt_lens)
    keys = jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(jax.random.key(self.seed), i)))(jnp.arange(b))
    return DFlashState(window=window, keys=keys, base=jnp.asarray(prompt_lens, jnp.int32))

  def logits(self, dparams, dstate: DFlashState, last, target_len, n_positions: int | None = None) -> jax.Array:
    """The drafter's logits [B, n, V] for the tokens at target_len + 1 .. target_len + n
    (n = n_positions <= block_size - 1, default max_draft)."""
    n = self.max_draft if n_positions is None else n_positions
    tp, dp = dparams["target"], dparams["dflash"]
    b, bk = last.shape[0], self.dc.block_size
    x = block_inputs(dp, tp, self.cfg, self.dc, last)                              # [B, Bk, D]
    positions = target_len[:, None] + jnp.arange(bk, dtype=jnp.int32)[None, :]    # [B, Bk]
    win = dstate.window
    mask = jnp.concatenate([jnp.broadcast_to(win.valid[:, None, :], (b, bk, win.size)),
                            jnp.ones((b, bk, bk), bool)], axis=2)                 # [B, Bk, W + Bk]
    h = model_of(dp, self.cfg, self.dc)(x, positions, win.feats, win.pos, mask)    # [B, Bk, D]
    return draft_logits(dp, tp, self.cfg, self.dc, h[:, 1:n + 1])                 # [B, n, V]

  def propose(self, dparams, dstate: DFlashState, ctx: DraftContext) -> tuple[Draft, DFlashState]:
    b, k = ctx.last.shape[0], self.max_draft
    logits = self.logits(dparams, dstate, ctx.last, ctx.target_len)
    shape = SamplingParams(temperature=ctx.temperature, top_k=jnp.zeros((b,), jnp.int32),
                           top_p=jnp.ones((b,), jnp.float32), seed=jnp.zeros((b,), jnp.uint32))
    q = shaped_probs(logits, shape)                                                # [B, K, V]; greedy: one-hot
    keys, use = split_keys(dstate.keys)
    tokens = jax.vmap(lambda key, qq: jax.random.categorical(jax.random.wrap_key_data(key), jnp.log(qq), axis=-1))(
        use, q).astype(jnp.int32)                                                  # [B, K]
    conf = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)                       # [B, K]
    sure = jnp.cumprod((conf >= ctx.p_min[:, None]).astype(jnp.int32), axis=1)
    lengths = jnp.minimum(jnp.sum(sure, axis=1), ctx.n_max).astype(jnp.int32)
    return (Draft(tokens=tokens, lengths=lengths, q=q),
            dataclasses.replace(dstate, keys=keys, base=ctx.target_len))

  def begin_chunk(self, dparams, dstate: DFlashState, ctx: DraftContext) -> DFlashState:
    """What propose leaves for commit (the anchor's position, the sampler key step); no drafting."""
    keys, _ = split_keys(dstate.keys)
    return dataclasses.replace(dstate, keys=keys, base=ctx.target_len)

  def commit(self, dparams, dstate: DFlashState, result: RoundResult) -> DFlashState:
    """Write the features of [last, d1..dn] (positions base .. base+n) into the window."""
    feats = self.fuse(dparams, result.layer_taps)                                  # [B, K+1, D]
    k1 = feats.shape[1]
    positions = dstate.base[:, None] + jnp.arange(k1, dtype=jnp.int32)[None, :]
    count = jnp.where(result.live, result.n_accepted + 1, 0)
    return dataclasses.replace(dstate, window=dstate.window.append(feats, positions, count))

  # context edits outside the engine's loop (a server trimming or shifting a sequence's context)
  def trim(self, dstate: DFlashState, length) -> DFlashState:
    return dataclasses.replace(dstate, window=dstate.window.trim(length))

  def shift(self, dstate: DFlashState, keep, discard) -> DFlashState:
    return dataclasses.replace(dstate, window=dstate.window.shift(keep, discard))


# ----------------------------------------------------------------------------------------------
# saving and loading: bf16 safetensors (HF-style names, [out, in]) + a JSON config


def _names(path: tuple[str, ...]) -> list[str]:
  """Parameter path -> tensor names. Fused q/k/v and gate/up are stored as their HF parts:
  `layers.0.self_attn.q_proj.weight`, `fc.weight` [D, n_taps * D], ..."""
  if path[-1] == "mask_embedding":
    return ["mask_embedding"]
  return hf_names(path)


def drafter_paths(path: str | Path) -> tuple[Path, Path]:
  """(weights, config): `X.safetensors` + `X.json`, or a directory with `dflash.safetensors` + `dflash.json`."""
  return head_file.head_paths(path, FORMAT)


def save_dflash(path: str | Path, dparams, cfg: ModelConfig, dc: DFlashConfig, *, dtype="bfloat16",
                extra: dict | None = None) -> tuple[Path, Path]:
  flat = tensors_from(params_of(dparams), _names, fused_sizes(layer_config(cfg, dc)), dtype=dtype)
  config = {"dtype": str(jnp.dtype(dtype)), "dflash": dataclasses.asdict(dc), "target_config": dataclasses.asdict(cfg),
            **(extra or {})}
  return head_file.save_head(path, FORMAT, flat, config)   # in shards past ~19 MB (dflash-2.safetensors, ...)


def read_drafter_tensors(flat: dict, cfg: ModelConfig, dc: DFlashConfig, what: str, dtype=None) -> dict:
  """Drafter params from the file tensors of a drafter of shape `dc` (this layout or z-lab's: the
  same names)."""
  abstract = abstract_params(lambda: DFlashModel(cfg, dc, rngs=nnx.Rngs(0)))
  pure, used = params_from_tensors(abstract, flat, _names, what=what, dtype=dtype, int_keys=True)
  refuse_unplaced(flat, used, what, "this drafter")
  return pure


def load_dflash(path: str | Path, cfg: ModelConfig, dtype=None) -> tuple[dict, DFlashConfig, dict]:
  """(drafter params, its DFlashConfig, the JSON config) for target `cfg`; refuses a drafter
  trained for a target of other sizes. `dtype` casts (default: as stored). A folder in z-lab's
  layout (config.json + safetensors) loads too (`dflash_reference.load_reference`)."""
  from specjax.drafters.dflash_reference import is_reference_folder, load_reference
  if is_reference_folder(path):
    return load_reference(path, cfg, dtype)
  flat, meta, wpath = head_file.load_head(path, FORMAT)
  what = f"DFlash drafter {wpath}"
  check_target(meta, cfg, ("arch", "vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim"), what, strict=True)
  if max(meta["dflash"]["taps"]) >= cfg.n_layers:
    raise UserError(f"{what} was trained for another target: taps {meta['dflash']['taps']} exceed its layers")
  d = dict(meta["dflash"])
  dc = DFlashConfig(**{**d, "taps": tuple(d["taps"]), "layer_fields": tuple(d.get("layer_fields", ()))})
  return read_drafter_tensors(flat, cfg, dc, what, dtype), dc, meta


def drafter_for_target(target, head, *, block_size: int | None = None,
                       window: int | None = None) -> tuple[dict, DFlashConfig]:
  """(drafter params in the target's dtype, DFlashConfig with `block_size` / `window` overrides) of
  a trained drafter (path, or (params, config)) for a loaded target."""
  dtype = jax.tree_util.tree_leaves(target.params)[0].dtype
  if isinstance(head, (str, Path)):
    dparams, dc, _ = load_dflash(head, target.logical_cfg, dtype=dtype)
  else:
    dparams, dc = head
    dparams = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), dparams)
  return dparams, dataclasses.replace(dc, block_size=block_size or dc.block_size, window=window or dc.window)


def make_dflash_drafter(target, head, draft_params=None, *, block_size: int | None = None, seed: int = 0,
                        window: int | None = None) -> DFlashDrafter:
  """The `dflash` speculator for a loaded target and a trained drafter (path, or (params, config)).
  max_draft = the largest n_max of `draft_params` (default block_size - 1); `block_size` and
  `window` override the trained ones (drafting with a shorter block than trained is allowed)."""
  dparams, dc = drafter_for_target(target, head, block_size=block_size, window=window)
  n_max = dc.block_size - 1
  if draft_params is not None:
    n_max = int(np.max(np.asarray(draft_params.n_max)))
  if n_max > dc.block_size - 1:
    raise UserError(f"n_max {n_max} exceeds the block's {dc.block_size - 1} drafts; raise block_size")
  return DFlashDrafter(cfg=target.logical_cfg, dc=dc, max_draft=max(n_max, 1), seed=seed,
                       weights={"dflash": dparams, "target": target.params})
