"""`eagle3` / `eagle3_tree`: an EAGLE-3 head (`specjax/drafters/eagle3.py`) drafting chains or
EAGLE-2 dynamic trees.

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
log-probability (the node budget, the speculator's `n_nodes` option) form the tree (ancestor-closed:
a child never scores above its parent, and ties go to the earlier, parent, index). Candidates are
deterministic, so the tree has no q (the verifier treats each as one-hot: lossless under sampling).
Adaptive drafting asks for smaller budgets (`propose_budget`): the best n candidates lie at most n
levels deep, so a budget-n tree drafts min(depth, n) levels and is the nodes of rank < n of the
full tree; at budget 0 only the root entry is written (what `commit` needs).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import PLAIN_CHUNK_STEPS, DeviceDrafter, Draft, DraftContext, RoundResult
from specjax.drafters.eagle3 import Eagle3Config, head_module, head_step, load_head
from specjax.engine.sampling import split_keys
from specjax.engine.tree import TreeDraft, best_nodes, empty_draft, n_candidates, node_budget, score_rank
from specjax.models.decoder import embed_tokens
from specjax.models.kv_cache import KVCache


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
  chunk_commit = True            # commit reads the verified tokens and taps (adaptive width 0: plain chunks)
  hc: Eagle3Config
  max_draft: int = 4
  weights: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
  seed: int = 0                   # seeds the draft sampler (independent of the target's sampler)
  name: str = "eagle3"
  kv_on_model: bool = False      # KV caches split over "model" (set by `parallel.place_drafter`)

  @property
  def taps(self) -> tuple[int, ...]:
    return self.hc.taps

  @property
  def extra_slots(self) -> int:
    """Head cache slots beyond the engine's capacity that drafting or a plain chunk's commit may write."""
    return PLAIN_CHUNK_STEPS

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

  def begin_chunk(self, dparams, dstate: Eagle3State, ctx: DraftContext) -> Eagle3State:
    """Propose's root entry alone (what commit's entries follow) and its sampler key step; no
    draft steps."""
    _, cache = self._root(dparams, dstate, ctx)
    key, _ = split_keys(dstate.key)
    return dataclasses.replace(dstate, cache=cache, base=ctx.target_len, key=key)

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
  node and k nodes expanded per level, the best `max_draft` candidates (the node budget, the
  speculator's `n_nodes` option). A sequence's n_max caps the depth verified (`verify_tree`)."""
  depth: int = 6
  top_k: int = 8
  name: str = "eagle3_tree"
  proposes_tree = True            # class attributes: the engine verifies a TreeDraft,
  budgeted = True                 # and adaptive drafting may ask for fewer nodes (`propose_budget`)

  def __post_init__(self):
    if self.depth < 1 or self.top_k < 1:
      raise ValueError(f"depth and top_k must be >= 1, got depth={self.depth}, top_k={self.top_k}")
    if not 1 <= self.max_draft <= self.n_candidates:
      raise ValueError(f"node budget n_nodes {self.max_draft} must be in [1, {self.n_candidates}], the candidates "
                       f"of depth {self.depth}, top_k {self.top_k}")

  @property
  def max_depth(self) -> int:
    """Deepest node of a tree (the engine's accepted paths are [B, max_depth] wide)."""
    return self.depth

  @property
  def n_candidates(self) -> int:
    return n_candidates(self.depth, self.top_k)

  @property
  def extra_slots(self) -> int:
    return max((self.depth - 1) * self.top_k, PLAIN_CHUNK_STEPS)

  def propose_tree(self, dparams, dstate: Eagle3State, ctx: DraftContext, budget: int | None = None):
    """The best `budget` (default max_draft) nodes, from min(depth, budget) levels. -> (tokens [B, T]
    target ids, parents [B, T], n_nodes [B], scores [B, T], state)."""
    hp, d2t, tp = _weights(dparams)
    b, kk, t = ctx.last.shape[0], self.top_k, self.max_draft if budget is None else budget
    depth = min(self.depth, t)
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
    for lvl in range(1, depth):
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
      if lvl < depth - 1:
        f_score, pick = jax.lax.top_k(c_score, kk)                                  # [B, k] next frontier
        f_parent = pick // kk                                                       # index among this level's nodes
        f_tok = jnp.take_along_axis(c_tok, pick, axis=1)
        f_pool = offset + pick
        f_h = jnp.take_along_axis(o, f_parent[:, :, None], axis=1)
      offset += kk * kk
    pool_tok, pool_score, pool_parent = (jnp.concatenate(x, axis=1) for x in (pool_tok, pool_score, pool_parent))
    draft_ids, parents, scores = best_nodes(pool_tok, pool_score, pool_parent, t)  # [B, T] x3
    n_nodes = jnp.where(ctx.n_max > 0, t, 0).astype(jnp.int32)                    # [B] 0: no drafting
    state = dataclasses.replace(dstate, cache=cache.with_lengths(root_len), base=ctx.target_len)
    return d2t[draft_ids], parents, n_nodes, scores, state

  def propose(self, dparams, dstate: Eagle3State, ctx: DraftContext):
    return self.propose_budget(dparams, dstate, ctx, self.max_draft)

  def begin_chunk(self, dparams, dstate: Eagle3State, ctx: DraftContext) -> Eagle3State:
    return self.propose_budget(dparams, dstate, ctx, 0)[1]      # trees draw no keys

  def propose_budget(self, dparams, dstate: Eagle3State, ctx: DraftContext, n_nodes: int):
    """The tree of the best `n_nodes` nodes, ranked by score; at 0 the root entry alone."""
    if n_nodes == 0:
      _, cache = self._root(dparams, dstate, ctx)
      return empty_draft(ctx.last.shape[0]), dataclasses.replace(dstate, cache=cache, base=ctx.target_len)
    tokens, parents, n, scores, state = self.propose_tree(dparams, dstate, ctx, n_nodes)
    return TreeDraft(tokens=tokens, parents=parents, n_nodes=n, rank=score_rank(scores)), state


def make_eagle3_drafter(target, head, draft_params=None, *, tree: bool = False, hc: Eagle3Config | None = None,
                        d2t=None, n_nodes: int | None = None, **opts):
  """The `eagle3` (chain) or `eagle3_tree` speculator for a loaded target and a head path (or loaded
  params, with `hc` and `d2t`). The chain's max_draft is the largest n_max of `draft_params` (default
  4); the tree's node budget is `n_nodes` (default min(32, the candidates)); `opts`: depth, top_k
  (trees), seed."""
  dtype = jax.tree_util.tree_leaves(target.params)[0].dtype
  if isinstance(head, (str, Path)):
    hp, d2t, hc, _ = load_head(head, target.logical_cfg, dtype=dtype)
  else:
    hp = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), head)
  weights = {"head": hp, "d2t": jnp.asarray(d2t, jnp.int32), "target": target.params}
  if tree:
    depth, top_k = opts.get("depth", Eagle3TreeDrafter.depth), opts.get("top_k", Eagle3TreeDrafter.top_k)
    return Eagle3TreeDrafter(hc=hc, max_draft=node_budget(n_nodes, depth, top_k), weights=weights, **opts)
  if n_nodes is not None:
    raise ValueError("n_nodes is the node budget of a tree (eagle3_tree)")
  n_max = int(np.max(np.asarray(draft_params.n_max))) if draft_params is not None else 4
  return Eagle3Drafter(hc=hc, max_draft=max(n_max, 1), weights=weights, **opts)
