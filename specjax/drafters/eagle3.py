"""`eagle3` / `eagle3_tree`: EAGLE-3 heads drafting chains or EAGLE-2 dynamic trees.

The head (SafeAILab EAGLE-3, `docs/REFERENCE.md` section 5):
  g_p   = fc(concat(low_p, mid_p, high_p))                 the target's hidden states entering layers
                                                           2, N//2 and N-3 (3 x d_model -> d_model)
  h'    = layer(concat(input_layernorm(embed(t)), hidden_norm(h)))   one llama decoder layer whose q/k/v
                                                           read the 2 x d_model concatenation; its residual
                                                           stream starts from h
  logits = lm_head(norm(h'))                               over a reduced draft vocabulary of Vd tokens;
                                                           `d2t[i]` is draft token i's target id
The embedding is the target's (frozen). Recursive drafting feeds the head's own pre-norm output h'
back as h.

Entries and positions (as `specjax/drafters/mtp.py`). The head's KV cache holds one committed
entry per position p: `(g_p, x_{p+1})`. Drafting from base i = target_len - 1:
  step 0: the committed entry (g_i, last) at position i          -> d1
  step j: the draft entry (h'_{j-1}, d_j) at position i + j       -> d_{j+1}
A draft entry sees the committed entries and its own ancestors (a chain: every earlier draft entry;
a tree: the entries on its root path). Training (`specjax/train/eagle3.py`, the training-time test)
uses exactly this visibility. `commit` rolls the cache back to target_len (dropping every draft
entry) and writes the accepted tokens with the target's taps from verification, so the head never
conditions on its own hidden states for committed positions; the newest `g` (the one that predicted
the new `last`) waits in `pending` until `propose` learns `last`.

Chain (`Eagle3Drafter`): greedy rows take the head's argmax (q one-hot), sampled rows draw from the
head's distribution at the row's temperature and return it as q (mapped onto the target vocabulary,
zero outside the draft vocabulary), so verification stays exact. `p_min` cuts a draft before a step
whose head distribution's top probability is below it (a function of the accepted prefix only, so
sampling stays lossless).

Tree (`Eagle3TreeDrafter`, EAGLE-2): the root's top-k children form level 1; each further level
expands the k best frontier nodes (by cumulative log-probability) into their top-k children, all
k x k of which become candidates, for `depth` levels; the `max_draft` best candidates by cumulative
log-probability form the tree (ancestor-closed: a child never scores above its parent, and ties go
to the earlier, parent, index). Candidates are deterministic, so the tree has no q (the verifier
treats each as one-hot: lossless under sampling).
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
from specjax.drafters.head_file import (abstract_params, check_target, fused_sizes, graphdef_of, hf_names, params_of,
                                        params_from_tensors, refuse_unplaced, tensors_from)
from specjax.models.config import ModelConfig
from specjax.models.decoder import attention_masks, embed_tokens, model_of
from specjax.models.layers import MLP, Linear, RMSNorm, attend, rope
from specjax.engine.sampling import split_keys
from specjax.models.kv_cache import KVCache
from specjax.engine.tree import best_nodes

FORMAT = "specjax-eagle3-v1"


def default_tap_layers(n_layers: int) -> tuple[int, int, int]:
  """EAGLE-3 fuses the hidden states *entering* layers 2, N//2 and N-3, i.e. the outputs of layers
  1, N//2 - 1 and N - 4 (clipped into the model for tiny test configs)."""
  return tuple(min(max(layer, 0), n_layers - 1) for layer in (1, n_layers // 2 - 1, n_layers - 4))


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
  """Static shape of a head: the target it drafts for, its draft vocabulary and MLP width, and
  which target layers (outputs) feed `fc` as low / mid / high."""
  target: ModelConfig
  draft_vocab: int
  ffn_dim: int
  tap_layers: tuple[int, int, int]

  @staticmethod
  def make(target: ModelConfig, draft_vocab: int, ffn_dim: int | None = None, tap_layers=None) -> "Eagle3Config":
    if not 0 < draft_vocab <= target.vocab_size:
      raise ValueError(f"draft_vocab must be in [1, {target.vocab_size}], got {draft_vocab}")
    taps = tuple(int(x) for x in (tap_layers or default_tap_layers(target.n_layers)))
    if len(taps) != 3 or not all(0 <= t < target.n_layers for t in taps):
      raise ValueError(f"tap_layers must be 3 layer indices of the target (< {target.n_layers}), got {taps}")
    return Eagle3Config(target=target, draft_vocab=int(draft_vocab), ffn_dim=int(ffn_dim or target.ffn_dim),
                        tap_layers=taps)

  @property
  def layer(self) -> ModelConfig:
    """The head's decoder layer: llama-style whatever the target's family, the target's widths."""
    return self.target.replace(arch="llama", n_layers=1, layer_types=("full",), ffn_dim=self.ffn_dim,
                               sliding_window=None, qkv_bias=False, o_bias=False, qk_norm=False,
                               sandwich_norm=False, embed_scale=False, norm_offset=False, activation="silu",
                               query_scale=None, rope_local_theta=None)

  @property
  def taps(self) -> tuple[int, ...]:
    """The target layers to tap, sorted and unique (the order the decoder returns them in)."""
    return tuple(sorted(set(self.tap_layers)))

  @property
  def tap_slots(self) -> tuple[int, int, int]:
    """Index into the decoder's tapped tuple of low, mid, high."""
    return tuple(self.taps.index(t) for t in self.tap_layers)


class Eagle3Attention(nnx.Module):
  """The layer's projections: q/k/v read the 2 x d_model input (one fused matrix), o writes d_model."""

  def __init__(self, d: int, h: int, kvh: int, hd: int, *, dtype, rngs: nnx.Rngs):
    self.qkv_proj = Linear(2 * d, (h + 2 * kvh) * hd, bias=False, dtype=dtype, rngs=rngs)
    self.o_proj = Linear(h * hd, d, bias=False, dtype=dtype, rngs=rngs)


class Eagle3Layer(nnx.Module):
  """The head's decoder layer, split in two so that training can run its own attention:
  `project` (norms, q/k/v, rotary) and `finish` (o_proj, residual, MLP)."""

  def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
    d, h, kvh, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.hidden_norm = RMSNorm(d, cfg.norm_eps, offset=False, dtype=dtype)
    self.input_layernorm = RMSNorm(d, cfg.norm_eps, offset=False, dtype=dtype)
    self.self_attn = Eagle3Attention(d, h, kvh, hd, dtype=dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(d, cfg.norm_eps, offset=False, dtype=dtype)
    self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)
    self.n_heads, self.n_kv_heads, self.head_dim, self.theta = h, kvh, hd, cfg.rope_theta

  def project(self, emb, h, positions):
    """emb, h [B, T, D]; positions [B, T] -> q [B, T, H, hd], k, v [B, T, KVH, hd] (q, k rotated)."""
    b, t, _ = h.shape
    x = jnp.concatenate([self.input_layernorm(emb), self.hidden_norm(h.astype(emb.dtype))], axis=-1)   # [B, T, 2D]
    qkv = self.self_attn.qkv_proj(x)                                           # [B, T, (H+2KVH)*hd]
    nq, nk = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
    q = qkv[..., :nq].reshape(b, t, self.n_heads, self.head_dim)
    k = qkv[..., nq:nq + nk].reshape(b, t, self.n_kv_heads, self.head_dim)
    v = qkv[..., nq + nk:].reshape(b, t, self.n_kv_heads, self.head_dim)
    return rope(q, positions, self.theta), rope(k, positions, self.theta), v

  def finish(self, h, attn_out):
    """h [B, T, D] the residual input; attn_out [B, T, H, hd] -> h' [B, T, D] (pre-norm)."""
    b, t = h.shape[:2]
    x = h.astype(jnp.float32) + self.self_attn.o_proj(attn_out.reshape(b, t, -1))
    return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nnx.Module):
  def __init__(self, hc: Eagle3Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
    d = hc.target.d_model
    self.fc = Linear(3 * d, d, bias=False, dtype=dtype, rngs=rngs)
    self.midlayer = Eagle3Layer(hc.layer, dtype=dtype, rngs=rngs)
    self.norm = RMSNorm(d, hc.target.norm_eps, offset=False, dtype=dtype)
    self.lm_head = Linear(d, hc.draft_vocab, bias=False, dtype=dtype, rngs=rngs)
    self.scale = hc.layer.scale
    self.slots = hc.tap_slots

  def fuse(self, layer_taps):
    """The target's tapped hidden states (the decoder's tuple, [B, T, D] each) -> g [B, T, D]."""
    return self.fc(jnp.concatenate([layer_taps[s].astype(jnp.float32) for s in self.slots], axis=-1))

  def logits(self, h):
    """h' [B, T, D] -> draft-vocabulary logits [B, T, Vd] float32."""
    return self.lm_head(self.norm(h))


@functools.lru_cache(maxsize=None)
def head_graphdef(hc: Eagle3Config, dtype_name: str):
  return graphdef_of(lambda: Eagle3Head(hc, dtype=jnp.dtype(dtype_name), rngs=nnx.Rngs(0)))


def head_module(hp, hc: Eagle3Config) -> Eagle3Head:
  """The head as a module over parameters `hp` (a pure dict or nnx.State), inside a trace."""
  return nnx.merge(head_graphdef(hc, str(jax.tree_util.tree_leaves(hp)[0].dtype)), hp)


def init_head(hc: Eagle3Config, seed: int = 0, dtype=jnp.float32, *, target_params=None, d2t=None) -> dict:
  """Head parameters as a pure dict: matrices N(0, 1/d_in). With `target_params` and `d2t`, the
  final norm and LM head start as the target's own, restricted to the draft vocabulary."""
  pure = params_of(Eagle3Head(hc, dtype=dtype, rngs=nnx.Rngs(seed)))
  if target_params is not None:
    model = model_of(target_params, hc.target)
    w = model.embed_tokens.embedding[...] if model.lm_head is None else model.lm_head.kernel[...].T   # [V, D]
    pure["lm_head"]["kernel"] = jnp.asarray(w[jnp.asarray(d2t)].T, dtype)                            # [D, Vd]
    pure["norm"]["weight"] = jnp.asarray(model.norm.weight[...], dtype)
  return pure


def head_step(hp, hc: Eagle3Config, emb, h, cache: KVCache, positions, n_new, visible=None):
  """Run T entries (emb, h [B, T, D]) through the head's layer with its one-layer KV cache: written
  at slots `lengths .. lengths+T-1`, rotary `positions` [B, T], committed up to `n_new` [B].
  `visible` [B, T, S] (trees) replaces the default mask (committed slots + causal among the new).
  Returns (h' [B, T, D] pre-norm, cache)."""
  layer = head_module(hp, hc).midlayer
  q, k, v = layer.project(emb, h, positions)
  k_all, v_all = cache.write(0, k, v)                                              # [B, S, KVH, hd]
  if visible is None:
    visible = attention_masks(hc.layer, cache.lengths, positions, cache.capacity)["full"]
  out = attend(q, k_all, v_all, visible, hc.layer.scale)                          # [B, T, H, hd]
  return layer.finish(h, out), KVCache(k=(k_all,), v=(v_all,), lengths=cache.lengths + jnp.asarray(n_new, jnp.int32))


# ----------------------------------------------------------------------------------------------
# the draft vocabulary


def build_d2t(token_rows, vocab_size: int, draft_vocab: int, always=()) -> np.ndarray:
  """The `draft_vocab` most frequent target tokens of `token_rows` (an iterable of int arrays),
  plus `always` (e.g. EOS ids) whatever their counts, ties to the smaller id; sorted ascending.
  Returns d2t [Vd] int32: draft token i is target token d2t[i]."""
  counts = np.zeros(vocab_size, np.int64)
  for row in token_rows:
    counts += np.bincount(np.asarray(row, np.int64), minlength=vocab_size)[:vocab_size]
  forced = sorted({int(t) for t in always if 0 <= int(t) < vocab_size})
  counts[forced] = np.iinfo(np.int64).max
  order = np.argsort(-counts, kind="stable")                                       # frequent first, ties by id
  return np.sort(order[:draft_vocab]).astype(np.int32)


def t2d_mask(d2t, vocab_size: int):
  """[V] bool: target tokens the draft vocabulary holds."""
  return jnp.zeros((vocab_size,), bool).at[jnp.asarray(d2t)].set(True)


# ----------------------------------------------------------------------------------------------
# the drafters


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3State:
  cache: KVCache                  # the head's one-layer cache
  pending: jax.Array              # [B, D] fused taps g at target_len - 1 (predicted `last`)
  base: jax.Array                 # [B] target_len when the current draft was made
  key: jax.Array                  # [B, 2] uint32 PRNG state for sampled drafts


def _weights(dparams):
  return dparams["head"], dparams["d2t"], dparams["target"]


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(DeviceDrafter):
  """Chain drafter over an EAGLE-3 head. `weights` = {"head": head params, "d2t": [Vd] int32,
  "target": the target's params (embedding)}; hashable by static config only."""
  hc: Eagle3Config
  max_draft: int = 4
  weights: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
  seed: int = 0                   # seeds the draft sampler (independent of the target's sampler)
  name: str = "eagle3"

  @property
  def taps(self) -> tuple[int, ...]:
    return self.hc.taps

  @property
  def extra_slots(self) -> int:
    """Head cache slots beyond the engine's capacity that drafting may write."""
    return 0

  def params(self):
    return self.weights

  def init(self, dparams, prompt_tokens, prompt_lens, prefill_taps, capacity: int) -> Eagle3State:
    """Warm the head on the prompt: entries (g_p, x_{p+1}) for p < prompt_len - 1; g at
    prompt_len - 1 waits (`pending`) for the first sampled token."""
    hp, _, tp = _weights(dparams)
    b, t = prompt_tokens.shape
    g = head_module(hp, self.hc).fuse(prefill_taps["layers"])                      # [B, T, D]
    nxt = jnp.concatenate([prompt_tokens[:, 1:], jnp.zeros((b, 1), prompt_tokens.dtype)], axis=1)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    n_new = jnp.maximum(prompt_lens - 1, 0)
    dtype = jax.tree_util.tree_leaves(hp)[0].dtype
    cache = KVCache.init(self.hc.layer, b, capacity + self.extra_slots, dtype=dtype)
    _, cache = head_step(hp, self.hc, embed_tokens(tp, self.hc.target, nxt), g, cache, positions, n_new)
    pending = jnp.take_along_axis(g, n_new[:, None, None], axis=1)[:, 0]           # [B, D]
    rows = jnp.arange(b, dtype=jnp.uint32)
    key = jax.vmap(lambda r, n: jax.random.key_data(jax.random.fold_in(jax.random.fold_in(
        jax.random.key(self.seed), r), n)))(rows, prompt_lens.astype(jnp.uint32))
    return Eagle3State(cache=cache, pending=pending, base=prompt_lens, key=key)

  def _root(self, dparams, dstate: Eagle3State, ctx: DraftContext):
    """Write the committed entry (pending, last) at position target_len - 1 -> (h' [B, 1, D], cache)."""
    hp, _, tp = _weights(dparams)
    emb = embed_tokens(tp, self.hc.target, ctx.last[:, None])                      # [B, 1, D]
    ones = jnp.ones_like(ctx.target_len)
    return head_step(hp, self.hc, emb, dstate.pending[:, None], dstate.cache, (ctx.target_len - 1)[:, None], ones)

  def propose(self, dparams, dstate: Eagle3State, ctx: DraftContext) -> tuple[Draft, Eagle3State]:
    hp, d2t, tp = _weights(dparams)
    b, k, v = ctx.last.shape[0], self.max_draft, self.hc.target.vocab_size
    head = head_module(hp, self.hc)
    key, use = split_keys(dstate.key)
    greedy = ctx.temperature <= 0.0
    temp = jnp.where(greedy, 1.0, ctx.temperature)[:, None]

    def pick(h, j):   # h [B, 1, D] -> token [B], top probability [B], q over the target vocabulary [B, V]
      logits = head.logits(h)[:, 0]                                                # [B, Vd]
      conf = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)
      shaped = jax.nn.softmax(logits / temp, axis=-1)
      keys = jax.vmap(lambda kk: jax.random.fold_in(jax.random.wrap_key_data(kk), j))(use)
      drawn = jax.vmap(lambda kk, p: jax.random.categorical(kk, jnp.log(p)))(keys, shaped)
      idx = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)   # [B] draft ids
      q_d = jnp.where(greedy[:, None], jax.nn.one_hot(idx, self.hc.draft_vocab, dtype=jnp.float32), shaped)
      q = jnp.zeros((b, v), jnp.float32).at[:, d2t].set(q_d)                        # [B, V]
      return d2t[idx], conf, q

    out, cache = self._root(dparams, dstate, ctx)
    tok, conf, q = pick(out, 0)
    active = (conf >= ctx.p_min) & (ctx.n_max > 0)
    tokens, qs, lengths = [tok], [q], active.astype(jnp.int32)
    for j in range(1, k):
      emb = embed_tokens(tp, self.hc.target, tok[:, None])
      out, cache = head_step(hp, self.hc, emb, out, cache, (ctx.target_len - 1 + j)[:, None], jnp.ones_like(lengths))
      tok, conf, q = pick(out, j)
      active = active & (conf >= ctx.p_min) & (j < ctx.n_max)
      tokens.append(tok)
      qs.append(q)
      lengths = lengths + active.astype(jnp.int32)
    draft = Draft(tokens=jnp.stack(tokens, axis=1), lengths=lengths, q=jnp.stack(qs, axis=1))   # [B, K], [B, K, V]
    return draft, dataclasses.replace(dstate, cache=cache, base=ctx.target_len, key=key)

  def commit(self, dparams, dstate: Eagle3State, result: RoundResult) -> Eagle3State:
    """Drop the draft entries; write (g_p, x_{p+1}) for the accepted tokens with the target's taps
    from verification; the g that predicted the new `last` waits. `verified` is [last, accepted
    path..., padding] for chains and trees alike."""
    hp, _, tp = _weights(dparams)
    n = jnp.where(result.live, result.n_accepted, 0)                              # [B]
    k = result.verified.shape[1] - 1
    base = dstate.base
    g = head_module(hp, self.hc).fuse(result.layer_taps)                           # [B, K+1, D]
    emb = embed_tokens(tp, self.hc.target, result.verified[:, 1:])                  # [B, K, D]
    positions = base[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    _, cache = head_step(hp, self.hc, emb, g[:, :k], dstate.cache.with_lengths(base), positions, n)
    cache = cache.with_lengths(jnp.where(result.live, base + n, base - 1))
    at_n = jnp.take_along_axis(g, n[:, None, None], axis=1)[:, 0]                  # [B, D]
    pending = jnp.where(result.live[:, None], at_n.astype(dstate.pending.dtype), dstate.pending)
    return dataclasses.replace(dstate, cache=cache, pending=pending)


@dataclasses.dataclass(frozen=True)
class Eagle3TreeDrafter(Eagle3Drafter):
  """EAGLE-2 dynamic trees over an EAGLE-3 head: `depth` levels, `top_k` children per expanded
  node and k nodes expanded per level, the best `max_draft` candidates (the node budget)."""
  depth: int = 6
  top_k: int = 8
  name: str = "eagle3_tree"
  proposes_tree = True            # class attribute: the engine verifies a TreeDraft

  def __post_init__(self):
    if self.depth < 1 or self.top_k < 1:
      raise ValueError(f"depth and top_k must be >= 1, got depth={self.depth}, top_k={self.top_k}")
    if self.max_draft > self.n_candidates:
      raise ValueError(f"node budget {self.max_draft} exceeds the {self.n_candidates} candidates of depth "
                       f"{self.depth}, top_k {self.top_k}")

  @property
  def max_depth(self) -> int:
    """Deepest node of a tree (the engine's accepted paths are [B, max_depth] wide)."""
    return self.depth

  @property
  def n_candidates(self) -> int:
    return self.top_k + (self.depth - 1) * self.top_k * self.top_k

  @property
  def extra_slots(self) -> int:
    return (self.depth - 1) * self.top_k

  def propose_tree(self, dparams, dstate: Eagle3State, ctx: DraftContext):
    """-> (tokens [B, T] target ids, parents [B, T], n_nodes [B], scores [B, T], state)."""
    hp, d2t, tp = _weights(dparams)
    b, kk, t = ctx.last.shape[0], self.top_k, self.max_draft
    head = head_module(hp, self.hc)
    base_pos = ctx.target_len - 1                                                  # [B] the root's position
    out, cache = self._root(dparams, dstate, ctx)
    root_len = cache.lengths                                                       # [B] committed + root
    logp = jax.nn.log_softmax(head.logits(out)[:, 0], axis=-1)                      # [B, Vd]
    f_score, f_tok = jax.lax.top_k(logp, kk)                                       # [B, k] level 1
    pool_tok, pool_score, pool_parent = [f_tok], [f_score], [jnp.full((b, kk), -1, jnp.int32)]
    f_pool = jnp.broadcast_to(jnp.arange(kk, dtype=jnp.int32)[None], (b, kk))     # pool index of frontier nodes
    f_h = jnp.broadcast_to(out, (b, kk, out.shape[-1]))                           # h' of each node's parent
    slot = jnp.arange(cache.capacity, dtype=jnp.int32)[None, None, :]             # [1, 1, S]
    vis = slot < root_len[:, None, None]                                          # [B, 1, S] committed + root
    f_parent = jnp.zeros((b, kk), jnp.int32)
    offset = kk
    for lvl in range(1, self.depth):
      start = root_len + (lvl - 1) * kk                                            # [B] slots of this level's entries
      own = slot == (start[:, None] + jnp.arange(kk, dtype=jnp.int32)[None, :])[:, :, None]   # [B, k, S]
      vis = jnp.take_along_axis(vis, f_parent[:, :, None], axis=1) | own if lvl > 1 else vis | own
      emb = embed_tokens(tp, self.hc.target, d2t[f_tok])                           # [B, k, D]
      pos = jnp.broadcast_to((base_pos + lvl)[:, None], (b, kk))
      o, cache = head_step(hp, self.hc, emb, f_h, cache.with_lengths(start), pos, kk, visible=vis)   # [B, k, D]
      c_score, c_tok = jax.lax.top_k(jax.nn.log_softmax(head.logits(o), axis=-1), kk)   # [B, k, k]
      c_score = (f_score[:, :, None] + c_score).reshape(b, kk * kk)
      c_tok = c_tok.reshape(b, kk * kk)
      pool_tok.append(c_tok)
      pool_score.append(c_score)
      pool_parent.append(jnp.repeat(f_pool, kk, axis=1))
      if lvl < self.depth - 1:
        f_score, pick = jax.lax.top_k(c_score, kk)                                  # [B, k] next frontier
        f_parent = pick // kk                                                       # index among this level's nodes
        f_tok = jnp.take_along_axis(c_tok, pick, axis=1)
        f_pool = offset + pick
        f_h = jnp.take_along_axis(o, f_parent[:, :, None], axis=1)
      offset += kk * kk
    pool_tok, pool_score, pool_parent = (jnp.concatenate(x, axis=1) for x in (pool_tok, pool_score, pool_parent))
    draft_ids, parents, scores = best_nodes(pool_tok, pool_score, pool_parent, t)  # [B, T] x3
    n_nodes = jnp.clip(ctx.n_max, 0, t).astype(jnp.int32)
    state = dataclasses.replace(dstate, cache=cache.with_lengths(root_len), base=ctx.target_len)
    return d2t[draft_ids], parents, n_nodes, scores, state

  def propose(self, dparams, dstate: Eagle3State, ctx: DraftContext):
    from specjax.engine.tree import TreeDraft
    tokens, parents, n_nodes, _, state = self.propose_tree(dparams, dstate, ctx)
    return TreeDraft(tokens=tokens, parents=parents, n_nodes=n_nodes), state


# ----------------------------------------------------------------------------------------------
# saving and loading: bf16 safetensors (EAGLE-3 tensor names, [out, in]) + a JSON config


def _file_names(path: tuple[str, ...]) -> tuple[list[str], bool]:
  """Parameter path -> (tensor names in the file, stored transposed?). EAGLE-3's names:
  `fc.weight`, `midlayer.self_attn.q_proj.weight`, `midlayer.mlp.gate_proj.weight`, `norm.weight`,
  `lm_head.weight`; fused projections stored as their parts."""
  return hf_names(path)


def head_paths(path: str | Path) -> tuple[Path, Path]:
  """(weights, config): `X.safetensors` + `X.json`, or a directory with `eagle3_head.*`."""
  return head_file.head_paths(path, FORMAT)


def head_tensors(hp, d2t, hc: Eagle3Config, dtype="bfloat16") -> dict:
  """The file tensors of a head: its weights as `dtype` under EAGLE-3's names ([out, in], fused
  projections split), `d2t` in EAGLE-3's offset form (target id - draft id, int64) and `t2d`
  (bool [V])."""
  flat = tensors_from(params_of(hp), _file_names, fused_sizes(hc.layer), dtype=dtype)
  d2t = np.asarray(d2t, np.int64)
  flat["d2t"] = d2t - np.arange(len(d2t), dtype=np.int64)
  flat["t2d"] = np.asarray(t2d_mask(d2t, hc.target.vocab_size))
  return flat


def save_head(path: str | Path, hp, d2t, hc: Eagle3Config, *, dtype="bfloat16", extra: dict | None = None):
  """Write the head (`head_tensors`) as safetensors and a JSON config (target config, head shape,
  `extra`)."""
  config = {"dtype": str(jnp.dtype(dtype)), "draft_vocab": hc.draft_vocab, "ffn_dim": hc.ffn_dim,
            "tap_layers": list(hc.tap_layers), "target_config": dataclasses.asdict(hc.target), **(extra or {})}
  return head_file.save_head(path, FORMAT, head_tensors(hp, d2t, hc, dtype), config)


def read_head_tensors(flat: dict, hc: Eagle3Config, what: str, dtype=None) -> tuple[dict, np.ndarray]:
  """(head params, d2t [Vd] int32) from the file tensors of a head of shape `hc` (this layout or
  the reference one: the same names); a file without `d2t` drafts over the first Vd ids."""
  flat = dict(flat)
  d2t = (flat.pop("d2t") + np.arange(hc.draft_vocab)).astype(np.int32) if "d2t" in flat \
      else np.arange(hc.draft_vocab, dtype=np.int32)
  flat.pop("t2d", None)
  abstract = abstract_params(lambda: Eagle3Head(hc, rngs=nnx.Rngs(0)))
  pure, used = params_from_tensors(abstract, flat, _file_names, what=what, dtype=dtype)
  refuse_unplaced(flat, used, what)
  return pure, d2t


def load_head(path: str | Path, cfg: ModelConfig, dtype=None) -> tuple[dict, np.ndarray, Eagle3Config, dict]:
  """(head params as a pure dict, d2t [Vd] int32, its Eagle3Config, JSON config) for target `cfg`;
  refuses a head trained for a target of other sizes. A folder in the reference layout (the EAGLE
  code / SpecForge / SGLang / vLLM: `config.json` + safetensors) loads too."""
  from specjax.drafters.eagle3_reference import is_reference_folder, load_reference
  if is_reference_folder(path):
    return load_reference(path, cfg, dtype)
  flat, meta, wpath = head_file.load_head(path, FORMAT)
  check_target(meta, cfg, ("arch", "vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "n_layers"),
               f"EAGLE-3 head {wpath}")
  hc = Eagle3Config.make(cfg, meta["draft_vocab"], meta["ffn_dim"], meta["tap_layers"])
  pure, d2t = read_head_tensors(flat, hc, f"EAGLE-3 head {wpath}", dtype)
  return pure, d2t, hc, meta


def make_eagle3_drafter(target, head, draft_params=None, *, tree: bool = False, hc: Eagle3Config | None = None,
                        d2t=None, **opts):
  """The `eagle3` (chain) or `eagle3_tree` speculator for a loaded target and a head path (or loaded
  params, with `hc` and `d2t`). The chain's max_draft / the tree's node budget is the largest n_max
  of `draft_params` (default 4 / 32); `opts`: depth, top_k (trees), seed."""
  dtype = jax.tree_util.tree_leaves(target.params)[0].dtype
  if isinstance(head, (str, Path)):
    hp, d2t, hc, _ = load_head(head, target.cfg, dtype=dtype)
  else:
    hp = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), head)
  weights = {"head": hp, "d2t": jnp.asarray(d2t, jnp.int32), "target": target.params}
  n_max = int(np.max(np.asarray(draft_params.n_max))) if draft_params is not None else (32 if tree else 4)
  cls = Eagle3TreeDrafter if tree else Eagle3Drafter
  return cls(hc=hc, max_draft=max(n_max, 1), weights=weights, **opts)
