"""Token trees: verification of a tree of draft tokens in one target pass, lossless acceptance,
and compaction of the accepted path's KV entries.

A tree drafter proposes T nodes after the sequence's `last` token (the root). Nodes are in
topological order (a parent's index is below its children's); `parents[i] = -1` hangs node i off
the root. The target scores [last, node_0 .. node_{T-1}] at once: node i sits at rotary position
`base + depth(i)` and attends to the committed cache, the root and its own ancestors (itself
included), so its logits are those of the sequence root -> ... -> i.

Acceptance walks from the root. At the current node, its children are tried in index order; a
child x drafted from q is accepted with probability min(1, p'(x) / q(x)), where p' starts as the
target's distribution at the current node; on rejection p' <- normalize(max(p' - q, 0)). An
accepted child becomes the current node (p' = the target's distribution there); when every child
is rejected the bonus token is drawn from the final p'. This is SpecInfer's multi-step speculative
sampling: lossless when each child's token was drawn from its q independently of its siblings
(given the context), or, with `q = None`, for any candidates that are a function of the context
(one-hot q: "accept with probability p'(x), else zero x out of p' and renormalize"). Greedy
target rows are one-hot, so the same procedure is "follow the argmax while a child drafted it".

The accepted path's entries sit in the cache at scattered slots `base + 1 + node`; `compact_path`
moves them to consecutive slots `base + 1 .. base + n_accepted`, where a plain decode would have
written them (slot == position, as every other cache user assumes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.base import Draft
from specjax.kernels import compact_path as compact_kernel
from specjax.models.kv_cache import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeDraft:
  tokens: jax.Array               # [B, T] int32 node tokens, topological order (parent index < own index)
  parents: jax.Array              # [B, T] int32: -1 = child of the root (`last`), else the parent node index
  n_nodes: jax.Array              # [B] int32 valid nodes; nodes >= n_nodes are padding (never accepted)
  q: jax.Array | None = None      # [B, T, V] float32 draft distribution each node was drawn from (at its
                                  # parent, shaped by the sequence's sampling params); None = one-hot
  rank: jax.Array | None = None   # [B, T] int32 each node's place in the drafter's order of preference: its
                                  # tree at node budget n is the nodes of rank < n (`score_rank`); None = the
                                  # node index (a layout whose first n nodes are its budget-n tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeShape:
  """What the verifier derives from `parents`: validity, ancestry and depth of every node."""
  parents: jax.Array              # [B, T] int32 parents, -1 for padding and for out-of-order entries
  valid: jax.Array                # [B, T] bool: node < n_nodes and depth <= max_depth
  ancestors: jax.Array            # [B, T, T] bool: [i, j] = node j is node i or one of its ancestors
  depth: jax.Array                # [B, T] int32: 1 for children of the root


DEFAULT_NODES = 32             # a best-first tree's node budget when none is given (at most its candidates)


def n_candidates(depth: int, top_k: int) -> int:
  """Nodes of a best-first tree's candidate pool (EAGLE-2's, DFlash tree's): the top_k children of
  the root, then top_k x top_k at every later level (the top_k best frontier nodes expanded)."""
  return top_k + (depth - 1) * top_k * top_k


def node_budget(n_nodes: int | None, depth: int, top_k: int) -> int:
  """The node budget of a best-first tree: `n_nodes`, or by default min(DEFAULT_NODES, its candidates)."""
  return min(DEFAULT_NODES, n_candidates(depth, top_k)) if n_nodes is None else int(n_nodes)


def best_nodes(pool_tok, pool_score, pool_parent, budget: int):
  """The best `budget` nodes of a drafter's candidate pool [B, P] (tokens, scores, parent pool index
  or -1), scores falling along every path and parents before their children in the pool, so the
  chosen nodes (ties: the lower index, the parent first) are closed under taking prefixes. ->
  (tokens [B, T], parents [B, T] remapped to the chosen nodes' indices (-1: child of the root),
  scores [B, T]), in topological order."""
  b = pool_score.shape[0]
  _, chosen = jax.lax.top_k(pool_score, budget)
  chosen = jnp.sort(chosen, axis=1)                                                # [B, T] topological order
  rows = jnp.arange(b)[:, None]
  slot_of = jnp.full(pool_score.shape, -1, jnp.int32).at[rows, chosen].set(jnp.arange(budget, dtype=jnp.int32)[None])
  par_pool = jnp.take_along_axis(pool_parent, chosen, axis=1)                      # [B, T]
  parents = jnp.where(par_pool < 0, -1, jnp.take_along_axis(slot_of, jnp.maximum(par_pool, 0), axis=1))
  return (jnp.take_along_axis(pool_tok, chosen, axis=1), parents.astype(jnp.int32),
          jnp.take_along_axis(pool_score, chosen, axis=1))


def empty_draft(batch: int) -> Draft:
  """A tree round's draft at node budget 0: no token (the round verifies `last` alone)."""
  return Draft(tokens=jnp.zeros((batch, 0), jnp.int32), lengths=jnp.zeros((batch,), jnp.int32))


def score_rank(scores: jax.Array) -> jax.Array:
  """[B, T] int32 rank of each node of a best-first tree by its score [B, T] (0 = the best; ties: the
  lower index first, as `best_nodes` chose them): the tree of the best n nodes is the nodes of
  rank < n, at any n up to T."""
  t = scores.shape[1]
  idx = jnp.arange(t)
  better = (scores[:, None, :] > scores[:, :, None]) | (
      (scores[:, None, :] == scores[:, :, None]) & (idx[None, :] < idx[:, None])[None])   # [B, T, T] j before i
  return jnp.sum(better, axis=2, dtype=jnp.int32)


def path_rank(tree: TreeDraft, path: jax.Array) -> jax.Array:
  """[B, D] int32 rank (`TreeDraft.rank`) of the accepted path's node at each depth; -1 past the path
  (path [B, D] node indices, -1 past it)."""
  rank = tree.rank if tree.rank is not None else jnp.broadcast_to(
      jnp.arange(tree.tokens.shape[1], dtype=jnp.int32)[None], tree.tokens.shape)
  return jnp.where(path >= 0, jnp.take_along_axis(rank, jnp.maximum(path, 0), axis=1), -1)


def max_depth_of(drafter) -> int:
  """Static bound D on the depth of a drafter's trees: its `max_depth` attribute if it has one,
  else its node budget (a chain of T nodes). Accepted paths are [B, D] wide."""
  t = int(drafter.max_draft)
  return max(1, min(int(getattr(drafter, "max_depth", t) or t), t))


def tree_shape(parents: jax.Array, n_nodes: jax.Array, max_depth: int | None = None) -> TreeShape:
  """Ancestors and depths of a batch of trees, by following parent links: hop k gives every node its
  k-th ancestor (a [B, T] gather; the hops fuse into a few kernels, where squaring the ancestor
  matrix took a product and a fusion per doubling). Padding nodes and nodes deeper than max_depth
  are invalid; the chase stops after max_depth hops, so such a node's depth reads max_depth + 1 and
  its ancestors beyond that are left out (an invalid node is never verified or attended to)."""
  b, t = parents.shape
  idx = jnp.arange(t, dtype=jnp.int32)
  in_budget = idx[None, :] < n_nodes[:, None]                                      # [B, T]
  par = jnp.where(in_budget & (parents < idx[None, :]), parents, -1)              # [B, T] sanitized
  hops = t - 1 if max_depth is None else min(max_depth, t - 1)
  up = jnp.broadcast_to(idx[None, :], (b, t))                                      # [B, T] ancestor k hops up
  anc = jnp.broadcast_to(idx[:, None] == idx[None, :], (b, t, t))                  # [B, T, T] self
  depth = jnp.ones((b, t), jnp.int32)
  for _ in range(hops):
    up = jnp.where(up >= 0, jnp.take_along_axis(par, jnp.maximum(up, 0), axis=1), -1)
    anc = anc | (up[:, :, None] == idx[None, None, :])
    depth = depth + (up >= 0)
  valid = in_budget if max_depth is None else in_budget & (depth <= max_depth)
  return TreeShape(parents=par, valid=valid, ancestors=anc, depth=depth)


def tree_attention_mask(shape: TreeShape) -> jax.Array:
  """[B, T+1, T+1] visibility among [root, node_0 .. node_{T-1}]: everyone sees the root, a node
  sees its ancestors and itself."""
  b, t = shape.depth.shape
  root_row = jnp.zeros((b, 1, t + 1), bool).at[:, 0, 0].set(True)                 # [B, 1, T+1]
  node_rows = jnp.concatenate([jnp.ones((b, t, 1), bool), shape.ancestors], axis=2)   # [B, T, T+1]
  return jnp.concatenate([root_row, node_rows], axis=1)


def tree_positions(base: jax.Array, shape: TreeShape) -> jax.Array:
  """[B, T+1] rotary positions of [root, nodes]: base + depth (base [B] = the root's position)."""
  return base[:, None] + jnp.concatenate([jnp.zeros_like(shape.depth[:, :1]), shape.depth], axis=1)


def _split_uniforms(keys: jax.Array, t: int) -> tuple[jax.Array, jax.Array]:
  """Per-sequence keys [B, 2] -> (uniforms [B, T] for the nodes, keys [B, 2] for the bonus token)."""
  sub = jax.vmap(lambda k: jax.random.key_data(jax.random.split(jax.random.wrap_key_data(k), 2)))(keys)   # [B, 2, 2]
  u = jax.vmap(lambda k: jax.random.uniform(jax.random.wrap_key_data(k), (t,)))(sub[:, 0])               # [B, T]
  return u, sub[:, 1]


def _siblings_before(parents: jax.Array, valid: jax.Array) -> jax.Array:
  """[B, T, T] bool: [i, k] = valid node k < i has the same parent as node i."""
  t = parents.shape[1]
  earlier = jnp.arange(t)[None, :] < jnp.arange(t)[:, None]                        # [T, T]: k < i
  return (parents[:, :, None] == parents[:, None, :]) & earlier[None] & valid[:, None, :]


def _accept_one_hot(p, tokens, parents, shape, u):
  """Acceptance for deterministic candidates (one-hot q), all nodes at once.

  With one-hot q the residual after rejecting siblings x_1..x_m is p with those tokens zeroed,
  renormalized, so child i (if tried) is accepted iff u_i * (1 - R_i) < p(x_i), R_i = the parent's
  p-mass on earlier distinct sibling tokens (a repeated token has p' = 0). Child i is tried iff its
  parent was reached and no earlier sibling was accepted; a node is on the accepted path iff it and
  every ancestor is the first acceptable child of its parent. Returns accepted [B, T] bool."""
  valid = shape.valid
  rows = parents + 1                                                               # [B, T] parent's row of p
  # one gather of B x T scalars (not the parents' [B, T, V] rows, then the token's column)
  p_tok = p[jnp.arange(p.shape[0])[:, None], rows, tokens]                         # [B, T] p(x_i) at its parent
  before = _siblings_before(parents, valid)                                        # [B, T, T]
  same_tok = tokens[:, :, None] == tokens[:, None, :]                              # [B, T, T]
  dup = jnp.any(before & same_tok, axis=2)                                         # [B, T] token already tried
  mass_before = jnp.sum(jnp.where(before & ~dup[:, None, :], p_tok[:, None, :], 0.0), axis=2)   # [B, T] R_i
  ok = valid & ~dup & (u * (1.0 - mass_before) < p_tok)                            # [B, T] acceptable if tried
  first_ok = ok & ~jnp.any(before & ok[:, None, :], axis=2)                        # [B, T]
  return valid & ~jnp.any(shape.ancestors & ~first_ok[:, None, :], axis=2)         # [B, T]


def _accept_sampled_q(p, tokens, parents, q, shape, u):
  """Acceptance with proper draft distributions q [B, T, V]: one sequential pass over the nodes in
  index order (children always come after their parent). Carry: the current node and its residual
  p'. Returns (accepted [B, T] bool, final residual [B, V])."""
  b, t = tokens.shape

  def step(carry, j):
    cur, resid = carry                                                             # [B] node (-1 root), [B, V]
    x = tokens[:, j]                                                               # [B]
    q_j = q[:, j]                                                                  # [B, V]
    tried = shape.valid[:, j] & (parents[:, j] == cur)                             # [B]
    p_x = jnp.take_along_axis(resid, x[:, None], axis=1)[:, 0]
    q_x = jnp.take_along_axis(q_j, x[:, None], axis=1)[:, 0]
    acc = tried & (u[:, j] * q_x < p_x)                                            # [B]
    left = jnp.maximum(resid - q_j, 0.0)
    mass = jnp.sum(left, axis=1, keepdims=True)
    left = jnp.where(mass > 0, left / jnp.where(mass > 0, mass, 1.0), resid)       # rejection leaves p' = q: keep p'
    resid = jnp.where(acc[:, None], p[:, j + 1], jnp.where(tried[:, None], left, resid))
    return (jnp.where(acc, j, cur), resid), acc

  (_, resid), acc = jax.lax.scan(step, (jnp.full((b,), -1, jnp.int32), p[:, 0]), jnp.arange(t))
  return jnp.transpose(acc), resid


def accept_tree(p: jax.Array, tree: TreeDraft, shape: TreeShape, keys: jax.Array,
                max_depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Lossless acceptance of the longest acceptable root-to-node path.

  p [B, T+1, V] shaped target distributions at [root, nodes]; keys [B, 2] per-sequence PRNG keys.
  Returns (n_accepted [B] = accepted path length in [0, max_depth], path [B, max_depth] node index
  at each depth 1..max_depth (-1 past the path), next_token [B] sampled after the path)."""
  b, t1, v = p.shape
  t = t1 - 1
  u, bonus_keys = _split_uniforms(keys, t)
  if tree.q is None:
    accepted = _accept_one_hot(p, tree.tokens, shape.parents, shape, u)
  else:
    accepted, resid = _accept_sampled_q(p, tree.tokens, shape.parents, tree.q, shape, u)
  acc_depth = jnp.where(accepted, shape.depth, 0)                                  # [B, T]
  n_acc = jnp.max(acc_depth, axis=1, initial=0)                                    # [B]
  leaf = jnp.where(n_acc > 0, jnp.argmax(acc_depth, axis=1), -1)                   # [B] deepest accepted (-1 root)
  at_depth = accepted[:, None, :] & (shape.depth[:, None, :] == jnp.arange(1, max_depth + 1)[None, :, None])   # [B, D, T]
  path = jnp.where(jnp.any(at_depth, axis=2), jnp.argmax(at_depth, axis=2), -1).astype(jnp.int32)   # [B, D]
  if tree.q is None:
    # Every child of the leaf was tried and rejected: the residual is p there minus their tokens.
    p_leaf = jnp.take_along_axis(p, (leaf + 1)[:, None, None], axis=1)[:, 0]      # [B, V]
    children = shape.valid & (shape.parents == leaf[:, None])                       # [B, T]
    tried = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], tree.tokens].max(children)   # [B, V]
    resid = jnp.where(tried, 0.0, p_leaf)
    mass = jnp.sum(resid, axis=1, keepdims=True)
    resid = jnp.where(mass > 0, resid / jnp.where(mass > 0, mass, 1.0), p_leaf)
  next_token = jax.vmap(lambda pr, k: jax.random.categorical(jax.random.wrap_key_data(k), jnp.log(pr)))(
      resid, bonus_keys).astype(jnp.int32)
  return n_acc.astype(jnp.int32), path, next_token


def compact_path(cache: KVCache, base: jax.Array, src: jax.Array) -> KVCache:
  """Move the accepted path's K/V into consecutive slots: slot base + j <- slot base + src[:, j]
  for j = 0..D (src [B, D+1]: 0 for the root, 1 + node index along the path; entries past the
  accepted length are moved too and stay uncommitted). Lengths are left to the caller."""
  n = len(cache.k)
  moved = compact_kernel.compact(tuple(cache.k) + tuple(cache.v), base, src)      # one launch with the kernel
  return dataclasses.replace(cache, k=moved[:n], v=moved[n:])
