"""The jitted device programs of the slot batch, and the row operations they share.

A slot batch is one `GenState` of batch B plus the drafter's state. Requests join by
`prefill_rows`: the joining prompts of one call, stacked as a batch of N rows (each its own slot,
length and position), are prefilled straight into their slots' rows (gathered, advanced, written
back); a row whose prompt ends in the call gets its first token, its `GenState` and its drafter
state there. Slots leave by `finish_rows` (masked), and `run_rounds` runs up to `rounds_max`
rounds in one `lax.while_loop` over the slots a call names (gathered into a smaller batch,
advanced and written back). Leaves without the slot axis (a drafter's table shared by every
sequence, a scalar) are recognised by comparing the batch-B pytree with a batch-1 one
(`slot_leaves`) and are carried whole.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax.drafters.base import Draft
from specjax.engine import Carry, RoundInputs, plain_chunks, run_round
from specjax.engine.adaptive_tree import PAST_PATH, ranks_on_path, shadow_ranks
from specjax.engine.decode import decode_step_counted
from specjax.engine.generation import GenState, emit, target_of
from specjax.engine.packed_tree import unpack
from specjax.engine.sampling import init_keys, next_token, split_keys
from specjax.engine.stats import RoundStats
from specjax.engine.tree import max_depth_of


def has_slot_axis(big, small) -> bool:
  """Whether leaf `big` of the batch-B pytree has the slot axis first, read from the same leaf at
  batch 1 (`small`): a drafter's table shared by every sequence or a scalar does not."""
  return not (big.ndim == 0 or small.ndim == 0 or small.shape[0] != 1 or big.shape[1:] != small.shape[1:])


@functools.partial(jax.jit, donate_argnames=("state",))
def finish_rows(state, mask):
  """Mark slots done (cancelled or left): the round masks them from now on."""
  return dataclasses.replace(state, done=state.done | mask)


def _per_row(flags, x):
  """flags [N] broadcast against leaf x [N, ...]."""
  return flags.reshape((-1,) + (1,) * (x.ndim - 1))


def gather_rows(tree, slots, mask):
  """Rows `slots` [N] of every slot-axis leaf (an index past the last slot reads the last one: a
  padding row, never written back); other leaves whole."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef.unflatten([jnp.take(x, slots, axis=0, mode="clip") if m else x for x, m in zip(leaves, mask)])


def scatter_rows(tree, slots, sub, mask, *, shared_from_sub: bool = False):
  """`tree` with rows `slots` [N] of its slot-axis leaves set from `sub` (an index past the last
  slot is dropped). Leaves without the slot axis keep `tree`'s value (a shared table is not reset by
  a request joining), or take `sub`'s with `shared_from_sub` (rounds over a bucket advanced them)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef.unflatten([x.at[slots].set(y, mode="drop") if m else (y if shared_from_sub else x)
                            for x, y, m in zip(leaves, treedef.flatten_up_to(sub), mask)])


def _select(flags, new, old, mask=None):
  """Per row: `new`'s leaves where flags [N], else `old`'s; with `mask` (`slot_leaves`) only on the
  slot-axis leaves, the others `new`'s (`scatter_rows` ignores them)."""
  leaves, treedef = jax.tree_util.tree_flatten(new)
  mask = mask if mask is not None else (True,) * len(leaves)
  return treedef.unflatten([jnp.where(_per_row(flags, a), a, b) if m else a
                            for a, b, m in zip(leaves, treedef.flatten_up_to(old), mask)])


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "capacity", "masks"), donate_argnames=("state", "dstate"))
def prefill_rows(params, dparams, state, dstate, rows, sampling, stop_ids, *, cfg, drafter, capacity, masks):
  """One prefill piece of each of N joining prompts, in one pass over the N rows, written into
  their slots. rows (`joining.PrefillRows`): slot [N] (past the last slot: padding), tokens [N, P]
  and n [N] (the piece, right-padded), fresh [N] (the piece starts the prompt: the row's target
  state starts empty), finish [N] (the prompt ends here), prompt [N, H] and prompt_len [N] (the
  whole prompt), max_new [N]; sampling [N]. A finishing row gets its first sampled token, its
  `GenState` (as `generation.prefill` builds it) and, for a device drafter, `drafter.init`'s
  state; a row mid-prompt gets only its target state (its slot stays done, so rounds skip it).
  Every row is computed on its own (per-row lengths and positions), so what a request gets does
  not depend on the rows beside it. `masks`: `slot_leaves` of state, dstate.
  -> (state, dstate, first token [N], done at it [N])."""
  params, dparams = unpack(params), unpack(dparams)
  target = target_of(cfg)
  n_rows, dtype = rows.tokens.shape[0], jax.tree_util.tree_leaves(params)[0].dtype
  old = gather_rows(state, rows.slot, masks[0])                                    # [N] rows of GenState
  cache = _select(rows.fresh, target.init_state(cfg, n_rows, capacity, dtype), old.cache)
  taps = drafter.taps if drafter is not None and drafter.on_device else ()
  logits, tapped, cache = target.forward(params, cfg, rows.tokens, cache, n_new=rows.n, taps=taps, last_only=True)
  keys, use = split_keys(init_keys(sampling))
  first = next_token(logits[:, 0], sampling, use)                                # [N]
  history = jnp.zeros((n_rows, capacity), jnp.int32).at[:, :rows.prompt.shape[1]].set(rows.prompt)
  joined = GenState(cache=cache, history=history, hist_len=rows.prompt_len, prompt_len=rows.prompt_len,
                    last=first, keys=keys, done=jnp.zeros((n_rows,), bool))
  joined, _ = emit(joined, first[:, None], jnp.ones((n_rows,), jnp.int32), stop_ids, rows.max_new)
  state = scatter_rows(state, rows.slot, _select(rows.finish, joined, dataclasses.replace(old, cache=cache)), masks[0])
  if drafter is not None and drafter.on_device:
    started = drafter.init(dparams, rows.prompt, rows.prompt_len, tapped, capacity)
    kept = gather_rows(dstate, rows.slot, masks[1])
    dstate = scatter_rows(dstate, rows.slot, _select(rows.finish, started, kept, masks[1]), masks[1])
  return state, dstate, joined.last, joined.done


def slot_leaves(big, small) -> tuple[bool, ...]:
  """`has_slot_axis` of every leaf of the batch-B pytree `big` against the batch-1 `small`."""
  return tuple(has_slot_axis(x, y) for x, y in zip(jax.tree_util.tree_leaves(big), jax.tree_util.tree_leaves(small)))


def new_tokens(state_before_len, state, width):
  """[B, width] history entries appended since `state_before_len` [B]."""
  cols = state_before_len[:, None] + jnp.arange(width)[None, :]
  return jnp.take_along_axis(state.history, jnp.minimum(cols, state.history.shape[1] - 1), axis=1)


def rank_depth(spec, ranks: bool) -> int:
  """D of the [R, b, D] ranks `run_rounds` reports: with `ranks`, a tree drafter's depth bound, else 0."""
  return spec.stats_width if ranks and spec.drafter is not None and spec.proposes_tree else 0


def _one_round(spec, inp: RoundInputs, host_draft, width: int, depth: int):
  """One round over a batch -> f(state, dstate) -> (state, dstate, [3, b] emitted / draft tokens
  verified / accepted, [b, depth] the accepted path's node ranks (`adaptive_tree.ranks_on_path`;
  depth 0: none reported)): `run_round` (the device drafter's, or verifying `host_draft`), or with
  neither drafter a plain decoding step."""
  if spec.drafter is None and host_draft is None:
    def plain(state, dstate):
      state, n = decode_step_counted(inp.params, spec.cfg, state, inp.sampling, inp.stop_ids, inp.max_new)
      return state, dstate, jnp.stack([n, jnp.zeros_like(n), jnp.zeros_like(n)]), jnp.zeros((n.shape[0], 0), jnp.int32)
    return plain

  def speculative(state, dstate):
    b = state.last.shape[0]
    stats = RoundStats.zeros(b, width)
    carry, v = run_round(spec, inp, Carry(state=state, dstate=dstate, stats=stats), host_draft=host_draft)
    if depth == 0 or v.path_rank is None:                     # not reported, or no tree this round (budget 0)
      rank = jnp.full((b, depth), PAST_PATH, jnp.int32)
    else:
      pr = v.path_rank[:, :depth]
      pr = jnp.pad(pr, ((0, 0), (0, depth - pr.shape[1])), constant_values=PAST_PATH)   # [b, D]
      rank = ranks_on_path(pr, v.n_accepted)
    return carry.state, carry.dstate, jnp.stack([v.n_out, v.n_verified, v.n_accepted]), rank
  return speculative


def _shadow_counts(spec, dp: dict, rounds_max: int, depth: int):
  """`plain_chunks`' shadow for the server: each chunk's shadow draft, logged at the chunk's first round
  as (draft positions observed [R, b], of them accepted [R, b], tree path ranks [R, b, D]), the form of
  a verified round's counts. Chains: a rejected draft counts its known positions (at least one, so a
  draft cut to nothing counts as rejected at its first position), a fully matched one its accepted
  tokens; trees: 1 where a shadow tree was walked (the slot was live), its path's accepted depth and
  node ranks (`adaptive_tree.shadow_path`)."""
  def observe(seen, draft, made, steps, start):
    drafted, accepted, ranks = seen
    at = jnp.minimum(start, rounds_max - 1)
    if spec.proposes_tree:
      rank, n_acc = shadow_ranks(draft, dp, made, steps, max_depth_of(spec.drafter))
      rank = rank[:, :depth]                                                        # [b, D]
      shown = steps > 0
      ranks = ranks.at[at].set(jnp.where(shown[:, None], rank, PAST_PATH))
      return drafted.at[at].set(shown.astype(jnp.int32)), accepted.at[at].set(n_acc), ranks
    acc, rej, known = plain_chunks.shadow_outcome(draft, dp, made, steps)
    return drafted.at[at].set(jnp.where(rej > 0, jnp.maximum(known, 1), acc)), accepted.at[at].set(acc), ranks
  return observe


@functools.partial(jax.jit, static_argnames=("spec", "rounds_max", "masks", "ranks", "shadow"),
                   donate_argnames=("state", "dstate"))
def run_rounds(spec, params, dparams, state, dstate, rows, sampling, dp, stop_ids, max_new, n_rounds,
               draft_tokens=None, draft_lengths=None, *, rounds_max, masks=None, ranks=False, shadow=False):
  """Up to `n_rounds` (<= rounds_max) rounds over the slots `rows` [b] (None: every slot), ending
  early once all of them are done (a slot stops at its stop token or max_new inside the loop, as
  the round's emission does, while the others go on). The rows are gathered into a batch-b state,
  advanced and written back, so a few live slots run a batch-b program. Rounds: the device
  drafter's, a plain decoding step (`spec.drafter` None), or one round verifying the host
  drafters' draft (draft_tokens [B, w], draft_lengths [B]). `masks`: `slot_leaves` of state, dstate.
  params / dparams: pytrees, or `PackedTree`s of them (cheaper to pass on every call).
  -> (state, dstate, new tokens [b, rounds_max * (W+1)], counts [3, rounds_max, b] (emitted, draft
  tokens verified, accepted, per round), done [b], rounds run, ranks [rounds_max, b, D]: with `ranks`
  (adaptive node budgets read them), a tree round's accepted-path node ranks; else D = 0). With
  `shadow`, rounds run as plain chunks start each chunk with a shadow draft (`engine.plain_chunks`):
  counts gains two rows, [5, rounds_max, b], its positions observed and accepted at the chunk's first
  round (`_shadow_counts`), and the ranks its tree's path; verified drafts' rows stay zero."""
  params, dparams = unpack(params), unpack(dparams)
  full_state, full_dstate = state, dstate
  if rows is not None:
    state, dstate = gather_rows(state, rows, masks[0]), gather_rows(dstate, rows, masks[1])
    sampling, dp, max_new, draft_tokens, draft_lengths = jax.tree_util.tree_map(
        lambda x: x[rows], (sampling, dp, max_new, draft_tokens, draft_lengths))
  host = None if draft_tokens is None else Draft(tokens=draft_tokens, lengths=draft_lengths)
  width = spec.stats_width if host is None else draft_tokens.shape[1]     # tokens a round emits, at most, - 1
  inp = RoundInputs(params=params, dparams=dparams, sampling=sampling, dp=dp, stop_ids=stop_ids, max_new=max_new)
  depth = rank_depth(spec, ranks)
  step = _one_round(spec, inp, host, width, depth)
  b = state.last.shape[0]

  def body(c):
    r, state, dstate, counts, path_ranks = c
    state, dstate, n, rank = step(state, dstate)
    return r + 1, state, dstate, counts.at[:, r].set(n.astype(jnp.int32)), path_ranks.at[r].set(rank)

  before = state.hist_len
  path_ranks = jnp.full((rounds_max, b, depth), PAST_PATH, jnp.int32)
  if host is None and plain_chunks.supports(spec):
    # width 0 of a drafter whose commit takes chunks: plain decoding steps, the drafter caught up per
    # chunk (`engine.plain_chunks`), instead of rounds that draft and drop
    carry = Carry(state=state, dstate=dstate, stats=RoundStats.zeros(b, width))
    zeros = jnp.zeros((rounds_max, b), jnp.int32)
    if shadow:
      seen = (zeros, zeros, path_ranks)
      carry, _, ran, emitted, (s_drafted, s_accepted, path_ranks) = plain_chunks.plain_chunks(
          spec, inp, jnp.minimum(n_rounds, rounds_max), carry, log_rounds=rounds_max,
          shadow=(seen, _shadow_counts(spec, dp, rounds_max, depth)))
      counts = jnp.stack([emitted, zeros, zeros, s_drafted, s_accepted])         # [5, rounds_max, b]
    else:
      carry, _, ran, emitted = plain_chunks.plain_chunks(spec, inp, jnp.minimum(n_rounds, rounds_max), carry,
                                                         log_rounds=rounds_max)
      counts = jnp.stack([emitted, zeros, zeros])                                 # [3, rounds_max, b]
    state, dstate = carry.state, carry.dstate
  else:
    start = (jnp.int32(0), state, dstate, jnp.zeros((3, rounds_max, b), jnp.int32), path_ranks)
    ran, state, dstate, counts, path_ranks = jax.lax.while_loop(lambda c: (c[0] < n_rounds) & ~jnp.all(c[1].done),
                                                                body, start)
    if shadow:                                                                     # no shadow drafts ran
      counts = jnp.concatenate([counts, jnp.zeros((2, rounds_max, b), jnp.int32)])
  new, done = new_tokens(before, state, rounds_max * (width + 1)), state.done
  if rows is not None:
    state = scatter_rows(full_state, rows, state, masks[0], shared_from_sub=True)
    dstate = scatter_rows(full_dstate, rows, dstate, masks[1], shared_from_sub=True)
  return state, dstate, new, counts, done, ran, path_ranks
