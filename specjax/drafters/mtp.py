"""`mtp`: multi-token-prediction heads (DeepSeek-V3's NextN layers) drafting from the target's own
hidden state.

One head: `h' = block(eh_proj(concat(enorm(embed(t_next)), hnorm(h))))`, where `h` is the target's
hidden state before its final norm at position p, `t_next` the token at p + 1, `block` one decoder
block of the target's family, and the target's final norm + LM head turn `h'` into logits for the
token at p + 2. Recursive drafting feeds `h'` back as `h` with the drafted token.

Entries and positions. The head's KV cache holds one entry per position p: `(h_p, x_{p+1})` with
the target's `h_p`; these are the *committed* entries. Drafting from base i = target_len - 1
(the position of the hidden state that predicted `last`):
  step 0: head 0 on the committed entry `(h_i, last)` at position i       -> d1
  step j: head m(j) on `(h'_{j-1}, d_j)` at position i + j                -> d_{j+1}
with m(j) = min(j, n_heads - 1): several heads are used one per step, the last one recursively.
Every head keeps its own cache of the committed entries (its own K/V weights), plus its own draft
entries of the current round; a draft entry sees the committed entries at positions <= i and the
head's own earlier draft entries. Training (`specjax/train/mtp.py`) uses exactly this visibility.

Cache bookkeeping (the invariant between rounds): every head cache holds the committed entries of
positions < target_len - 1; the entry at target_len - 1 pairs the target's newest hidden state
(`pending`, from the last verification) with `last`, which the drafter only learns in `propose`,
so `propose` writes it first (into every head), then drafts. `commit` rolls every cache back to
target_len (dropping draft entries) and writes the accepted tokens with the target's hidden states
from verification: the head then never conditions on its own guesses for committed positions.

Reference styles (`MTPDrafter.style`, heads loaded by `specjax/drafters/mtp_reference.py`): as
vLLM runs DeepSeek-V3's and Qwen3-Next's MTP layers, the committed entries read the target's
hidden state *after* its final norm, each head has its own final norm (and DeepSeek's its own LM
head copy, `weights["out"]`), step j uses head j % n_heads; "deepseek_v3" feeds the pre-norm
output back and zeroes the embedding at position 0, "qwen3_next" feeds the normed output back.

Families: the head's block is one full-attention layer of the target's family, a
`specjax.models.decoder.Block` or, for hybrid targets (Qwen3.5, `HybridConfig`), the gated-attention
`specjax.models.hybrid.HybridBlock` their built-in `mtp.*` layers are made of; the embedding, final
norm and LM head come from `target_ops(cfg)`, the module of the target's family.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters.base import PLAIN_CHUNK_STEPS, DeviceDrafter, Draft, DraftContext, RoundResult
from specjax.drafters import head_file
from specjax.drafters.head_file import (abstract_params, check_target, fused_sizes, graphdef_of, params_of,
                                        params_from_tensors, refuse_unplaced, tensors_from)
from specjax.models import decoder, hybrid
from specjax.models.config import ModelConfig
from specjax.models.decoder import Block, attention_masks
from specjax.models.hybrid import HybridBlock
from specjax.models.hybrid_config import HybridConfig
from specjax.models.kv_cache import KVCache
from specjax.models.layers import Linear, RMSNorm
from specjax.models.weights import hf_names

FORMAT = "specjax-mtp-v1"


def rms_norm(x, weight, eps: float, offset: bool):
  """RMSNorm of x [..., D] with a weight [D] held outside a module (as RMSNorm computes it)."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  w = weight.astype(jnp.float32) + (1.0 if offset else 0.0)
  return (xf * w).astype(x.dtype)


def block_config(cfg: ModelConfig | HybridConfig) -> ModelConfig | HybridConfig:
  """The head's one decoder block: the target's family and sizes, one full-attention layer."""
  return cfg.replace(n_layers=1, layer_types=("full",))


def target_ops(cfg: ModelConfig | HybridConfig):
  """The module with the target's pieces a head reads (`embed_tokens`, `final_norm`,
  `lm_head_logits`, `logits_from_prenorm`, all (params, cfg, x)): `specjax.models.hybrid` for a
  hybrid target, else `specjax.models.decoder`."""
  return hybrid if isinstance(cfg, HybridConfig) else decoder


class MTPHead(nnx.Module):
  """enorm, hnorm, eh_proj and one decoder block; the final norm and LM head are the target's."""

  def __init__(self, cfg: ModelConfig | HybridConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    d = cfg.d_model
    self.enorm = RMSNorm(d, cfg.norm_eps, offset=cfg.norm_offset, dtype=dtype)
    self.hnorm = RMSNorm(d, cfg.norm_eps, offset=cfg.norm_offset, dtype=dtype)
    self.eh_proj = Linear(2 * d, d, bias=False, dtype=dtype, rngs=rngs)
    block = HybridBlock if isinstance(cfg, HybridConfig) else Block
    self.block = block(block_config(cfg), 0, dtype=dtype, rngs=rngs)

  def __call__(self, emb, h, positions, write_kv, masks):
    """emb, h [B, T, d_model]; positions [B, T]; write_kv(k, v) -> (k_all, v_all); masks [B, T, S].
    Returns (h' [B, T, d_model] pre-norm, (k_all, v_all))."""
    x = jnp.concatenate([self.enorm(emb), self.hnorm(h.astype(emb.dtype))], axis=-1)   # [B, T, 2D]
    x = self.eh_proj(x)                                                                # [B, T, D]
    return self.block(x, positions, write_kv, masks)


@functools.lru_cache(maxsize=None)
def head_graphdef(cfg: ModelConfig, dtype_name: str):
  return graphdef_of(lambda: MTPHead(cfg, dtype=jnp.dtype(dtype_name), rngs=nnx.Rngs(0)))


def init_heads(cfg: ModelConfig, n_heads: int = 1, seed: int = 0, dtype=jnp.float32, *,
               init: str = "random", target_params=None, block_from_layer: int | None = None) -> tuple[dict, ...]:
  """Head parameters: a tuple of pure dicts, one per head.

  init "random": every matrix N(0, 1/d_in). init "identity": the head starts as the identity on the
  hidden state (eh_proj = [0 | I], the block's output projections o_proj and down_proj zero, so its
  residual branches start silent): its first logits are the target's own next-token logits, a
  sensible start that trains much faster than random logits. `block_from_layer` copies that
  target layer into each block instead (a warm start of another kind)."""
  if init not in ("random", "identity"):
    raise ValueError(f"init must be 'random' or 'identity', got {init!r}")
  d = cfg.d_model
  heads = []
  for m in range(n_heads):
    head = MTPHead(cfg, dtype=dtype, rngs=nnx.Rngs(seed + m))
    pure = params_of(head)
    if block_from_layer is not None:
      layers = nnx.to_pure_dict(target_params)["layers"]
      src = layers[block_from_layer % cfg.n_layers]
      pure["block"] = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), src)
    if init == "identity":
      pure["eh_proj"]["kernel"] = jnp.concatenate([jnp.zeros((d, d), dtype), jnp.eye(d, dtype=dtype)], axis=1)   # [D, 2D]
      if block_from_layer is None:
        for path in (("self_attn", "o_proj"), ("mlp", "down_proj")):
          node = pure["block"]
          for key in path:
            node = node[key]
          node["kernel"] = jnp.zeros_like(node["kernel"])
    heads.append(pure)
  return tuple(heads)


def heads_dtype(heads) -> str:
  return str(jax.tree_util.tree_leaves(heads)[0].dtype)


def apply_head(hparams, cfg: ModelConfig, emb, h, positions, write_kv, masks):
  """One head as a pure function of its parameters (a pure dict or nnx.State)."""
  head = nnx.merge(head_graphdef(cfg, heads_dtype(hparams)), hparams)
  return head(emb, h, positions, write_kv, masks)


def head_step(hparams, cfg: ModelConfig, emb, h, cache: KVCache, positions, n_new):
  """Run T entries through one head with its KV cache (one layer): written at slots
  `lengths .. lengths+T-1`, at rotary `positions` [B, T], committed up to `n_new` [B].
  Returns (h' [B, T, d_model], cache)."""
  masks = attention_masks(block_config(cfg), cache.lengths, positions, cache.capacity)
  out, (k, v) = apply_head(hparams, cfg, emb, h, positions, functools.partial(cache.write, 0), masks)
  return out, KVCache(k=(k,), v=(v,), lengths=cache.lengths + jnp.asarray(n_new, jnp.int32))


def head_for_step(j: int, n_heads: int, cycle: bool = False) -> int:
  """Drafting step j uses head min(j, n_heads - 1) (specjax), or j % n_heads (`cycle`: vLLM's MTP)."""
  return j % n_heads if cycle else min(j, n_heads - 1)


# ----------------------------------------------------------------------------------------------
# the drafter


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPState:
  caches: tuple[KVCache, ...]     # one per head, 1 layer each
  pending: jax.Array              # [B, d_model] target pre-norm hidden at target_len - 1 (predicted `last`)
  base: jax.Array                 # [B] target_len when the current draft was made


@dataclasses.dataclass(frozen=True)
class MTPDrafter(DeviceDrafter):
  """Device drafter over MTP heads. `weights` = {"heads": tuple of head params, "target": the
  target's params (embedding, final norm, LM head are shared)}; hashable by static config only."""
  chunk_commit = True            # commit reads the verified tokens and hidden states (adaptive width 0: plain chunks)
  cfg: ModelConfig                # the target's config
  n_heads: int = 1
  max_draft: int = 4
  weights: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
  unroll: bool = True             # draft steps unrolled (no loop condition read per step on a GPU);
                                  # False: a while_loop that stops once every sequence fell below p_min
  name: str = "mtp"
  taps: tuple[int, ...] = ()
  style: str = "specjax"          # "specjax" | "deepseek_v3" | "qwen3_next" (see the module docstring)
  kv_on_model: bool = False      # KV caches split over "model" (set by `parallel.place_drafter`)

  def params(self):
    return self.weights

  def _hidden(self, tp, prenorm):
    """The target hidden state the committed entries read [B, T, D]."""
    return prenorm if self.style == "specjax" else target_ops(self.cfg).final_norm(tp, self.cfg, prenorm)

  def _embed(self, tp, tokens, positions):
    """Token embeddings [B, T, D]; zero at position 0 in the DeepSeek style (vLLM's deepseek_mtp)."""
    emb = target_ops(self.cfg).embed_tokens(tp, self.cfg, tokens)
    return jnp.where((positions == 0)[..., None], 0.0, emb) if self.style == "deepseek_v3" else emb

  def _pick(self, dparams, m: int, o):
    """Head m's output o [B, 1, D] -> (greedy token [B], its probability [B], the state fed on)."""
    tp, ops = dparams["target"], target_ops(self.cfg)
    if self.style == "specjax":
      logits, fed = ops.logits_from_prenorm(tp, self.cfg, o), o
    else:
      out = dparams["out"][m]
      normed = rms_norm(o, out["norm"], self.cfg.norm_eps, self.cfg.norm_offset)   # [B, 1, D]
      logits = (ops.lm_head_logits(tp, self.cfg, normed) if "lm_head" not in out else
                jnp.einsum("btd,vd->btv", normed.astype(out["lm_head"].dtype), out["lm_head"],
                           preferred_element_type=jnp.float32))                  # [B, 1, V]
      fed = normed if self.style == "qwen3_next" else o
    probs = jax.nn.softmax(logits[:, 0].astype(jnp.float32), axis=-1)
    return jnp.argmax(probs, axis=-1).astype(jnp.int32), jnp.max(probs, axis=-1), fed

  def init(self, dparams, prompt_tokens, prompt_lens, prefill_taps, capacity: int) -> MTPState:
    """Warm every head on the prompt: entries (h_p, x_{p+1}) for p < prompt_len - 1; h at
    prompt_len - 1 waits (`pending`) for the first sampled token."""
    tp, heads = dparams["target"], dparams["heads"]
    b, t = prompt_tokens.shape
    prenorm = self._hidden(tp, prefill_taps["prenorm"])                             # [B, T, D]
    nxt = jnp.concatenate([prompt_tokens[:, 1:], jnp.zeros((b, 1), prompt_tokens.dtype)], axis=1)   # [B, T]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    emb = self._embed(tp, nxt, positions)
    n_new = jnp.maximum(prompt_lens - 1, 0)
    dtype = jax.tree_util.tree_leaves(heads)[0].dtype
    caches = []
    for hp in heads:
      # slots past the engine's capacity: a plain chunk's commit writes PLAIN_CHUNK_STEPS entries at once
      cache = KVCache.init(block_config(self.cfg), b, capacity + PLAIN_CHUNK_STEPS, dtype=dtype)
      _, cache = head_step(hp, self.cfg, emb, prenorm, cache, positions, n_new)
      caches.append(cache)
    pending = jnp.take_along_axis(prenorm, n_new[:, None, None], axis=1)[:, 0]       # [B, D]
    return MTPState(caches=tuple(caches), pending=pending, base=prompt_lens)

  def propose(self, dparams, dstate: MTPState, ctx: DraftContext) -> tuple[Draft, MTPState]:
    tp, heads = dparams["target"], dparams["heads"]
    b, k, nh = ctx.last.shape[0], self.max_draft, self.n_heads
    base_pos = ctx.target_len - 1                                                   # [B] position i
    ones = jnp.ones((b,), jnp.int32)

    cycle = self.style != "specjax"

    # step 0: the committed entry (pending, last) at position i, written into every head
    emb = self._embed(tp, ctx.last[:, None], base_pos[:, None])                     # [B, 1, D]
    caches = list(dstate.caches)
    out = None
    for m in range(nh):
      o, caches[m] = head_step(heads[m], self.cfg, emb, dstate.pending[:, None], caches[m], base_pos[:, None], ones)
      out = o if m == 0 else out
    tok0, conf0, out = self._pick(dparams, 0, out)
    active0 = (conf0 >= ctx.p_min) & (ctx.n_max > 0)
    tokens0 = jnp.zeros((b, k), jnp.int32).at[:, 0].set(tok0)

    def run_head(m, h, tok, caches, j):
      emb = self._embed(tp, tok[:, None], (base_pos + j)[:, None])
      caches = list(caches)
      o, caches[m] = head_step(heads[m], self.cfg, emb, h, caches[m], (base_pos + j)[:, None], ones)
      return (*self._pick(dparams, m, o), tuple(caches))

    def cond(c):
      j, _, _, _, active, _ = c
      return (j < k) & jnp.any(active)

    def body(c, static_j=None):
      j, h, caches, tokens, active, lengths = c
      prev = jax.lax.dynamic_index_in_dim(tokens, j - 1, axis=1, keepdims=False)    # [B]
      if static_j is not None or nh == 1:
        tok, conf, o, caches = run_head(head_for_step(static_j or 0, nh, cycle), h, prev, caches, j)
      else:
        branches = [functools.partial(run_head, m) for m in range(nh)]
        index = j % nh if cycle else jnp.minimum(j, nh - 1)
        tok, conf, o, caches = jax.lax.switch(index, branches, h, prev, caches, j)
      active = active & (conf >= ctx.p_min) & (j < ctx.n_max)
      tokens = jax.lax.dynamic_update_index_in_dim(tokens, tok, j, axis=1)
      return j + 1, o, caches, tokens, active, lengths + active.astype(jnp.int32)

    carry = (jnp.int32(1), out, tuple(caches), tokens0, active0, active0.astype(jnp.int32))
    if self.unroll:
      for j in range(1, k):
        carry = body(carry, static_j=j)
    else:
      carry = jax.lax.while_loop(cond, body, carry)
    _, _, caches, tokens, _, lengths = carry
    return Draft(tokens=tokens, lengths=lengths), dataclasses.replace(dstate, caches=caches, base=ctx.target_len)

  def begin_chunk(self, dparams, dstate: MTPState, ctx: DraftContext) -> MTPState:
    """Propose's step 0 alone: the committed entry (pending, last) at position target_len - 1 in
    every head, which commit's entries follow; no draft steps."""
    tp, heads = dparams["target"], dparams["heads"]
    base_pos = ctx.target_len - 1                                                   # [B]
    emb = self._embed(tp, ctx.last[:, None], base_pos[:, None])                     # [B, 1, D]
    ones = jnp.ones_like(base_pos)
    caches = tuple(head_step(hp, self.cfg, emb, dstate.pending[:, None], cache, base_pos[:, None], ones)[1]
                   for hp, cache in zip(heads, dstate.caches))
    return dataclasses.replace(dstate, caches=caches, base=ctx.target_len)

  def commit(self, dparams, dstate: MTPState, result: RoundResult) -> MTPState:
    """Drop the draft entries; write (h_p, x_{p+1}) for the accepted tokens with the target's
    hidden states from verification; the hidden state that predicted the new `last` waits."""
    tp, heads = dparams["target"], dparams["heads"]
    n = jnp.where(result.live, result.n_accepted, 0)                                # [B]
    k = result.verified.shape[1] - 1
    base = dstate.base
    hidden = self._hidden(tp, result.prenorm)                                       # [B, K+1, D]
    h = hidden[:, :k]                                                               # [B, K, D] at last, d1..
    positions = base[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    emb = self._embed(tp, result.verified[:, 1:], positions)                        # [B, K, D] d1..dK
    new_len = jnp.where(result.live, base + n, base - 1)
    caches = []
    for hp, cache in zip(heads, dstate.caches):
      _, cache = head_step(hp, self.cfg, emb, h, cache.with_lengths(base), positions, n)
      caches.append(cache.with_lengths(new_len))
    at_n = jnp.take_along_axis(hidden, n[:, None, None], axis=1)[:, 0]               # [B, D]
    pending = jnp.where(result.live[:, None], at_n.astype(dstate.pending.dtype), dstate.pending)
    return MTPState(caches=tuple(caches), pending=pending, base=base)


# ----------------------------------------------------------------------------------------------
# saving and loading heads: bf16 safetensors + a JSON config


def _file_names(path: tuple[str, ...]) -> list[str]:
  """A head parameter path -> tensor names in the file.

  The file uses HF / DeepSeek-style names and layout, whatever our module tree looks like:
  `enorm.weight`, `hnorm.weight`, `eh_proj.weight` [D, 2D], then the decoder layer's own
  (`input_layernorm.weight`, `self_attn.q_proj.weight`, `mlp.gate_proj.weight`, ...); fused
  projections are stored as their HF parts."""
  return hf_names(tuple(path[1:]) if path[0] == "block" else tuple(path))


def head_paths(path: str | Path) -> tuple[Path, Path]:
  """(weights, config) of a head: `X.safetensors` + `X.json`, or a directory with `mtp_head.*`."""
  return head_file.head_paths(path, FORMAT)


def save_heads(path: str | Path, heads: Sequence, cfg: ModelConfig, *, dtype="bfloat16",
               extra: dict | None = None) -> tuple[Path, Path]:
  """Write the heads as `dtype` safetensors (`mtp.{m}.<HF name>`, [out, in] layout) and a JSON
  config (the target config they were trained for, the head count, and `extra`)."""
  flat = {}
  for m, hp in enumerate(heads):
    flat.update(tensors_from(params_of(hp), _file_names, fused_sizes(cfg), dtype=dtype, prefix=f"mtp.{m}."))
  config = {"n_heads": len(heads), "dtype": str(jnp.dtype(dtype)), "target_config": dataclasses.asdict(cfg),
            **(extra or {})}
  return head_file.save_head(path, FORMAT, flat, config, tensor_metadata={"n_heads": str(len(heads))})


def load_heads(path: str | Path, cfg: ModelConfig, dtype=None) -> tuple[tuple[dict, ...], dict]:
  """(heads as a tuple of pure dicts, JSON config) for target config `cfg`; refuses a head trained
  for a target of other sizes. `dtype` casts (default: as stored)."""
  flat, meta, wpath = head_file.load_head(path, FORMAT, config_optional=True)
  check_target(meta, cfg, ("arch", "vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"),
               f"MTP head {wpath}")
  n_heads = int(meta.get("n_heads", 1 + max(int(k.split(".")[1]) for k in flat)))
  abstract = abstract_params(lambda: MTPHead(cfg, rngs=nnx.Rngs(0)))
  heads, used = [], set()
  for m in range(n_heads):
    pure, names = params_from_tensors(abstract, flat, _file_names, what=f"MTP head {wpath}", dtype=dtype,
                                      prefix=f"mtp.{m}.")
    heads.append(pure)
    used |= names
  refuse_unplaced(flat, used, f"MTP head {wpath}", "this target's head")
  return tuple(heads), meta


def make_mtp_drafter(target, head, draft_params=None, **opts) -> MTPDrafter:
  """The `mtp` speculator for a loaded target and a head path (or loaded heads); `opts` are
  MTPDrafter fields (e.g. unroll=False). A DeepSeek-V3 / Qwen3-Next layout folder loads too, and
  so does a checkpoint folder with its own MTP layers (a Qwen3.5 target's: the registry passes its
  folder when no head is given); `head` may be (heads, outs, style) of such heads."""
  from specjax.drafters import mtp_reference
  dtype = jax.tree_util.tree_leaves(target.params)[0].dtype
  cast = lambda tree: jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), tree)
  extra = {}
  if isinstance(head, (str, Path)) and mtp_reference.is_reference_folder(head):
    heads, outs, style, _ = mtp_reference.load_reference(head, target.logical_cfg, dtype=dtype)
    extra, opts = {"out": outs}, {"style": style, **opts}
  elif isinstance(head, tuple) and len(head) == 3 and isinstance(head[2], str):
    heads, extra, opts = cast(head[0]), {"out": cast(head[1])}, {"style": head[2], **opts}
  elif isinstance(head, (str, Path)):
    heads, _ = load_heads(head, target.logical_cfg, dtype=dtype)
  else:
    heads = tuple(cast(h) for h in head)
  n_max = 4
  if draft_params is not None:
    n_max = int(np.max(np.asarray(draft_params.n_max)))
  return MTPDrafter(cfg=target.logical_cfg, n_heads=len(heads), max_draft=max(n_max, 1),
                    weights={"heads": tuple(heads), "target": target.params, **extra}, **opts)
