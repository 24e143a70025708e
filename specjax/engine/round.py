"""One speculative round: draft -> verify -> accept -> commit, for a batch of sequences.

Every driver (the fixed device loop, the adaptive segment loop, the host loop, the server's slot
loop) runs `run_round`. What is static about a round is a `RoundSpec` (a jit static argument);
what is dynamic and fixed for a request is a `RoundInputs` pytree; what the loop carries is a
`Carry`. Verification of a chain and of a tree is chosen in one place (`spec.proposes_tree`);
the statistics are updated in one place; the result is a `Verdict`.

Lossless by construction: the target scores [last, draft...] in one pass, `accept_drafts` /
`accept_tree` keep the longest prefix the target's own sampler agrees with (rejection sampling
for non-greedy sequences) and resample the next token, and the target's state (KV lengths,
recurrent state) and the sampler's keys advance by the emitted tokens only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax import parallel
from specjax.drafters.base import Draft, DraftContext, RoundResult
from specjax.engine.decode import decode_step_counted
from specjax.engine.generation import GenState, emit, target_of
from specjax.engine.sampling import SamplingParams, shaped_probs, split_keys
from specjax.engine.stats import RoundStats
from specjax.engine.tree import (TreeDraft, accept_tree, compact_path, max_depth_of, path_rank, tree_attention_mask,
                                 tree_positions, tree_shape)
from specjax.engine.verify import accept_drafts
from specjax.models.decoder import DecoderTarget


@dataclasses.dataclass(frozen=True)
class RoundSpec:
  """What is static about a round (hashable: jitted loops take it as a static argument).

  drafter: a `DeviceDrafter` that drafts inside the round, or None when the draft comes from the
    host (host drafters) or there is none (plain decoding).
  width: chain draft tokens verified per round (<= drafter.max_draft); None: the drafter's own K.
    Width 0 with a commit-free drafter, or with no drafter (the host loop's rounds where no
    sequence drafts), is the plain decoding step (no drafting, no verification).
    Trees: the node budget of the round (a `budgeted` drafter drafts its best `width` nodes; 0: no
    tree, the drafter does only what its commit needs and the round verifies `last` alone).
  """
  cfg: Any
  drafter: Any = None
  rollback: str = "per_step"
  width: int | None = None

  @property
  def proposes_tree(self) -> bool:
    return self.drafter is not None and self.drafter.proposes_tree

  @property
  def drafter_kv_on_model(self) -> bool:
    """The drafter's KV caches are split over "model" (its attention weights are)."""
    return self.drafter is not None and self.drafter.kv_on_model

  @property
  def plain(self) -> bool:
    return self.width == 0 and (self.drafter is None or self.drafter.commit_free)

  @property
  def taps(self) -> tuple[int, ...]:
    return () if self.drafter is None else tuple(self.drafter.taps)

  @property
  def stats_width(self) -> int:
    """Positions the acceptance-by-position counters track (trees: depths)."""
    if self.drafter is None:
      return 0
    return max_depth_of(self.drafter) if self.proposes_tree else self.drafter.max_draft

  def prefill_spec(self) -> "RoundSpec":
    """The part of the spec the prefill depends on (one compilation for every width / rollback)."""
    return RoundSpec(cfg=self.cfg, drafter=self.drafter)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundInputs:
  """The arrays every round of a request reads."""
  params: Any                 # target weights
  dparams: Any                # drafter arrays (`DeviceDrafter.params()`; () otherwise)
  sampling: SamplingParams    # per-sequence sampling parameters
  dp: dict                    # per-sequence draft parameters: n_max [B], n_min [B], p_min [B]
  stop_ids: jax.Array         # [S] int32 stop tokens ([-1]: none)
  max_new: jax.Array          # [B] int32 token budget per sequence


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Carry:
  """What the loops carry from round to round."""
  state: GenState             # target state, token history, sampler keys, done flags
  dstate: Any                 # device drafter state (() for host drafters / plain decoding)
  stats: RoundStats


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verdict:
  """What verification decided for each sequence this round."""
  n_accepted: jax.Array       # [B] accepted draft tokens
  next_token: jax.Array       # [B] the token sampled after them (the new `last`)
  n_verified: jax.Array       # [B] draft tokens (chains) or tree nodes verified
  reach: jax.Array            # [B] chain: draft length; tree: depth of the deepest verified node
  path: jax.Array             # [B, W+1] [last, draft...] (trees: [last, accepted path...])
  taps: dict                  # target hidden states at `path`: "prenorm" [B, W+1, d], "layers"
  live: jax.Array             # [B] bool: the sequence was live this round
  n_out: jax.Array            # [B] tokens emitted (after stop-token / budget cuts)
  path_rank: jax.Array | None = None   # trees: [B, D] the drafter's rank of the accepted node at each depth
                                       # (-1 past the path): what smaller node budgets would have accepted


def draft_budget(spec: RoundSpec, inp: RoundInputs, state: GenState) -> jax.Array:
  """[B] tokens each sequence may draft this round: its n_max, capped at a chain round's width, 0 once
  done (a tree's n_max caps its depth, not its node budget)."""
  n_max = inp.dp["n_max"] if spec.width is None or spec.proposes_tree else jnp.minimum(inp.dp["n_max"], spec.width)
  return jnp.where(state.done, 0, n_max)


def draft_context(spec: RoundSpec, inp: RoundInputs, state: GenState) -> DraftContext:
  """What the device drafter sees of the round's state."""
  return DraftContext(last=state.last, history=state.history, hist_len=state.hist_len,
                      target_len=state.cache.lengths, n_max=draft_budget(spec, inp, state), p_min=inp.dp["p_min"],
                      temperature=inp.sampling.temperature)


def _narrow(draft: Draft, width: int | None) -> Draft:
  """A chain draft cut to the round's width (the verify pass is [B, width+1])."""
  if width is None or width >= draft.tokens.shape[1]:
    return draft
  return Draft(tokens=draft.tokens[:, :width], lengths=jnp.minimum(draft.lengths, width),
               q=None if draft.q is None else draft.q[:, :width])


def verify_chain(spec: RoundSpec, inp: RoundInputs, state: GenState, draft: Draft) -> tuple[GenState, Verdict]:
  """Score [last, d1..dK] with the target, accept the longest acceptable prefix plus one token,
  roll the target's state back to the accepted length (KV: by length; recurrent state:
  `spec.rollback`) and emit. Drafts shorter than n_min are not verified."""
  b, k = draft.tokens.shape
  live = ~state.done
  dlen = jnp.minimum(draft.lengths, inp.dp["n_max"])
  dlen = jnp.where((dlen < inp.dp["n_min"]) | ~live, 0, dlen)                      # [B]
  verified = jnp.concatenate([state.last[:, None], draft.tokens], axis=1)          # [B, K+1]
  target = target_of(spec.cfg, spec.rollback)
  logits, tapped, after, ckpt = target.verify(inp.params, spec.cfg, verified, state.cache, taps=spec.taps)  # [B, K+1, V]
  p = shaped_probs(logits, inp.sampling)
  keys, use = split_keys(state.keys)
  n_acc, nxt = accept_drafts(p, draft.tokens, dlen, use, draft.q)   # q: None = one-hot drafts
  n_acc = jnp.where(live, n_acc, 0)
  cache = target.commit(inp.params, spec.cfg, verified, state.cache, after, ckpt, jnp.where(live, 1 + n_acc, 0))
  idx = jnp.arange(k + 1)[None, :]
  emitted = jnp.where(idx == n_acc[:, None], nxt[:, None],
                      jnp.concatenate([draft.tokens, jnp.zeros((b, 1), jnp.int32)], axis=1))   # [B, K+1]
  state = dataclasses.replace(state, cache=cache, keys=keys)
  state, n_out = emit(state, emitted, jnp.where(live, n_acc + 1, 0), inp.stop_ids, inp.max_new)
  return state, Verdict(n_accepted=n_acc, next_token=nxt, n_verified=dlen, reach=dlen, path=verified, taps=tapped,
                        live=live, n_out=n_out)


def verify_tree(spec: RoundSpec, inp: RoundInputs, state: GenState, tree: TreeDraft) -> tuple[GenState, Verdict]:
  """Score [last, node_0..node_{T-1}] in one pass (tree positions and ancestor mask), accept the
  longest acceptable root-to-node path plus one token (`specjax.engine.tree`), move the path's KV
  entries into consecutive slots and emit. The tree's node budget is the drafter's (nodes past a
  sequence's `n_nodes` are padding); a sequence's n_max caps the depth of the nodes verified, as it
  caps a chain's length, and trees shallower than n_min are not verified."""
  if not isinstance(target_of(spec.cfg), DecoderTarget):
    raise NotImplementedError(
        "tree drafts are verified on attention-only targets; a hybrid target would need the recurrent "
        "state of every tree node (use a chain drafter with hybrid targets)")
  max_depth = max_depth_of(spec.drafter)
  b = tree.tokens.shape[0]
  live = ~state.done
  shape = tree_shape(tree.parents, jnp.where(live, tree.n_nodes, 0), max_depth)
  within = shape.valid & (shape.depth <= inp.dp["n_max"][:, None])                 # [B, T] depth cap n_max
  reach = jnp.max(jnp.where(within, shape.depth, 0), axis=1, initial=0)            # [B] deepest node kept
  deep_enough = reach >= inp.dp["n_min"]                                           # [B] else not verified
  valid = within & deep_enough[:, None]                                            # [B, T]
  reach = jnp.where(deep_enough, reach, 0)
  shape = dataclasses.replace(shape, valid=valid)
  base = state.cache.lengths                                                        # [B] position of `last`
  verified = jnp.concatenate([state.last[:, None], tree.tokens], axis=1)           # [B, T+1]
  logits, tapped, after = target_of(spec.cfg).forward(inp.params, spec.cfg, verified, state.cache, taps=spec.taps,
                                                      positions=tree_positions(base, shape),
                                                      attn_mask=tree_attention_mask(shape))   # [B, T+1, V]
  keys, use = split_keys(state.keys)
  n_acc, path, nxt = accept_tree(shaped_probs(logits, inp.sampling), tree, shape, use, max_depth)
  n_acc = jnp.where(live, n_acc, 0)
  idx = jnp.arange(max_depth + 1)[None, :]
  src = jnp.where(idx <= n_acc[:, None], jnp.concatenate([jnp.zeros((b, 1), jnp.int32), path + 1], axis=1), 0)  # [B, D+1]
  cache = compact_path(after, base, src).with_lengths(base + jnp.where(live, 1 + n_acc, 0))
  on_path = jnp.take_along_axis(verified, src, axis=1)                             # [B, D+1] [last, path...]
  on_path = jnp.where((idx == 0) | (idx <= n_acc[:, None]), on_path, 0)
  emitted = jnp.where(idx == n_acc[:, None], nxt[:, None],
                      jnp.concatenate([on_path[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1))   # [B, D+1]
  gather = lambda h: jnp.take_along_axis(h, src[:, :, None], axis=1)              # [B, D+1, d_model]
  tapped = {"prenorm": gather(tapped["prenorm"]), "layers": tuple(gather(h) for h in tapped["layers"])}
  state = dataclasses.replace(state, cache=cache, keys=keys)
  state, n_out = emit(state, emitted, jnp.where(live, n_acc + 1, 0), inp.stop_ids, inp.max_new)
  n_verified = jnp.sum(valid, axis=1, dtype=jnp.int32)                              # [B]
  return state, Verdict(n_accepted=n_acc, next_token=nxt, n_verified=n_verified, reach=reach, path=on_path,
                        taps=tapped, live=live, n_out=n_out, path_rank=path_rank(tree, path))


def _plain_step(spec: RoundSpec, inp: RoundInputs, state: GenState) -> tuple[GenState, Verdict]:
  """Width 0 of a commit-free drafter (or of the host loop): the plain decoding step, without
  drafting or the verification machinery, so backing off costs what plain decoding costs."""
  live = ~state.done
  state, n_out = decode_step_counted(inp.params, spec.cfg, state, inp.sampling, inp.stop_ids, inp.max_new)
  zeros = jnp.zeros_like(n_out)
  return state, Verdict(n_accepted=zeros, next_token=state.last, n_verified=zeros, reach=zeros,
                        path=state.last[:, None], taps={}, live=live, n_out=n_out)


def _pad_to(x, width: int):
  """[B, w, ...] -> [B, width, ...] with zeros."""
  return jnp.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def commit_width(spec: RoundSpec) -> int:
  """Verified tokens of the drafter's rounds as its commit sees them: a tree's depth + 1, a chain's K + 1."""
  return (max_depth_of(spec.drafter) if spec.proposes_tree else spec.drafter.max_draft) + 1


def _round_result(spec: RoundSpec, v: Verdict) -> RoundResult:
  """What the drafter's commit sees; arrays keep the drafter's width at every round width: K+1 for a
  chain, D+1 for a tree (a tree round at node budget 0 verifies `last` alone)."""
  pad = lambda x: _pad_to(x, commit_width(spec))
  return RoundResult(n_accepted=v.n_accepted, next_token=v.next_token, verified=pad(v.path),
                     prenorm=pad(v.taps["prenorm"]), layer_taps=tuple(pad(h) for h in v.taps["layers"]), live=v.live)


def _propose(spec: RoundSpec, inp: RoundInputs, dstate, state: GenState):
  """The device drafter's draft for the round: a chain cut to the round's width, or a tree at the
  round's node budget (an empty chain at budget 0)."""
  ctx = draft_context(spec, inp, state)
  if not spec.proposes_tree:
    draft, dstate = spec.drafter.propose(inp.dparams, dstate, ctx)
    return _narrow(draft, spec.width), dstate
  if spec.width is None or spec.width == spec.drafter.max_draft:
    return spec.drafter.propose(inp.dparams, dstate, ctx)
  return spec.drafter.propose_budget(inp.dparams, dstate, ctx, spec.width)


def run_round(spec: RoundSpec, inp: RoundInputs, carry: Carry, host_draft: Draft | None = None) -> tuple[Carry, Verdict]:
  """One round for every sequence: the device drafter proposes (or `host_draft` is the host's
  draft), the target verifies the chain or the tree, the statistics advance and the drafter
  commits what was accepted. Under a mesh the loop state keeps its layout (`parallel.constrain_state`;
  no-op on one device)."""
  b = carry.state.last.shape[0]
  state = parallel.constrain_state(carry.state)
  dstate = parallel.constrain_state(carry.dstate, b, kv_on_model=spec.drafter_kv_on_model)
  if spec.plain:
    state, verdict = _plain_step(spec, inp, state)
  else:
    draft = host_draft
    if draft is None:
      draft, dstate = _propose(spec, inp, dstate, state)
    verify = verify_tree if isinstance(draft, TreeDraft) else verify_chain
    state, verdict = verify(spec, inp, state, draft)
    if host_draft is None:
      dstate = spec.drafter.commit(inp.dparams, dstate, _round_result(spec, verdict))
  stats = carry.stats.update(verdict.reach, verdict.n_accepted, verdict.live, verdict.n_out,
                             n_verified=verdict.n_verified)
  return Carry(state=state, dstate=dstate, stats=stats), verdict
