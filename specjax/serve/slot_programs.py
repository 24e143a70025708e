"""The jitted device programs of the slot batch, and the row operations they share.

A slot batch is one `GenState` of batch B plus the drafter's state; a request is prefilled into
a private batch-1 state (`empty_cache`, `prefill_chunk`, `prefill_last`), scattered into its slot
(`insert_row`), masked when it leaves (`finish_rows`), and advanced by `run_rounds`: up to
`rounds_max` rounds in one `lax.while_loop` over the slots a call names (gathered into a smaller
batch, advanced and written back). Leaves without the slot axis (a drafter's table shared by
every sequence, a scalar) are recognised by comparing the batch-B pytree with a batch-1 one
(`slot_leaves`) and are carried whole.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax.drafters.base import Draft
from specjax.engine import Carry, RoundInputs, run_round
from specjax.engine.decode import decode_step_counted
from specjax.engine.generation import GenState, emit, target_of
from specjax.engine.sampling import init_keys, sample, shaped_probs, split_keys
from specjax.engine.stats import RoundStats


def has_slot_axis(big, small) -> bool:
  """Whether leaf `big` of the batch-B pytree has the slot axis first, read from the same leaf at
  batch 1 (`small`): a drafter's table shared by every sequence or a scalar does not."""
  return not (big.ndim == 0 or small.ndim == 0 or small.shape[0] != 1 or big.shape[1:] != small.shape[1:])


def scatter_row(big, small, slot):
  """Write batch-1 leaf `small` into row `slot` of `big` (leaves without the slot axis keep the
  running batch's value)."""
  return big.at[slot].set(small[0]) if has_slot_axis(big, small) else big


@functools.partial(jax.jit, donate_argnames=("state", "dstate"))
def insert_row(state, dstate, slot, state1, dstate1):
  """The running batch with slot `slot` replaced by a freshly prefilled request."""
  state = jax.tree_util.tree_map(lambda b, s: scatter_row(b, s, slot), state, state1)
  dstate = jax.tree_util.tree_map(lambda b, s: scatter_row(b, s, slot), dstate, dstate1)
  return state, dstate


@functools.partial(jax.jit, donate_argnames=("state",))
def finish_rows(state, mask):
  """Mark slots done (cancelled or left): the round masks them from now on."""
  return dataclasses.replace(state, done=state.done | mask)


@functools.partial(jax.jit, static_argnames=("cfg", "capacity", "dtype"))
def empty_cache(*, cfg, capacity, dtype):
  """A batch-1 target state of `capacity` positions (one dispatch, where building it op by op takes
  one per layer)."""
  return target_of(cfg).init_state(cfg, 1, capacity, dtype)


@functools.partial(jax.jit, static_argnames=("cfg",))
def prefill_chunk(params, cache, tokens, n, *, cfg):
  """Write one prompt chunk [1, P] (n valid tokens) into a batch-1 cache."""
  _, _, cache = target_of(cfg).forward(params, cfg, tokens, cache, n_new=n)
  return cache


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "history_len", "capacity"))
def prefill_last(params, dparams, cache, tokens, n, full_prompt, prompt_len, sampling, stop_ids, max_new, *,
                 cfg, drafter, history_len, capacity):
  """The last prompt chunk: logits at the last prompt token, the first sampled token, the batch-1
  `GenState` (as `generation.prefill` builds it) and the drafter's state."""
  taps = drafter.taps if drafter is not None and drafter.on_device else ()
  logits, tapped, cache = target_of(cfg).forward(params, cfg, tokens, cache, n_new=n, taps=taps, last_only=True)
  keys, use = split_keys(init_keys(sampling))
  first = sample(shaped_probs(logits, sampling)[:, 0], use)                       # [1]
  history = jnp.zeros((1, history_len), jnp.int32).at[:, :full_prompt.shape[1]].set(full_prompt)
  state = GenState(cache=cache, history=history, hist_len=prompt_len, prompt_len=prompt_len,
                   last=first, keys=keys, done=jnp.zeros((1,), bool))
  state, _ = emit(state, first[:, None], jnp.ones((1,), jnp.int32), stop_ids, max_new)
  dstate = ()
  if drafter is not None and drafter.on_device:
    dstate = drafter.init(dparams, full_prompt, prompt_len, tapped, capacity)
  return state, dstate


def slot_leaves(big, small) -> tuple[bool, ...]:
  """`has_slot_axis` of every leaf of the batch-B pytree `big` against the batch-1 `small`."""
  return tuple(has_slot_axis(x, y) for x, y in zip(jax.tree_util.tree_leaves(big), jax.tree_util.tree_leaves(small)))


def take_rows(tree, rows, mask):
  """The rows `rows` [b] of every slot-axis leaf of `tree` (`mask`: `slot_leaves`); other leaves whole."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef.unflatten([x[rows] if m else x for x, m in zip(leaves, mask)])


def put_rows(tree, rows, sub, mask):
  """`tree` with the rows `rows` of its slot-axis leaves replaced by `sub`'s (other leaves: `sub`'s)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef.unflatten([x.at[rows].set(y) if m else y
                            for x, y, m in zip(leaves, treedef.flatten_up_to(sub), mask)])


def new_tokens(state_before_len, state, width):
  """[B, width] history entries appended since `state_before_len` [B]."""
  cols = state_before_len[:, None] + jnp.arange(width)[None, :]
  return jnp.take_along_axis(state.history, jnp.minimum(cols, state.history.shape[1] - 1), axis=1)


def _one_round(spec, inp: RoundInputs, host_draft, width: int):
  """One round over a batch -> f(state, dstate) -> (state, dstate, [3, b] emitted / draft tokens
  verified / accepted): `run_round` (the device drafter's, or verifying `host_draft`), or with
  neither drafter a plain decoding step."""
  if spec.drafter is None and host_draft is None:
    def plain(state, dstate):
      state, n = decode_step_counted(inp.params, spec.cfg, state, inp.sampling, inp.stop_ids, inp.max_new)
      return state, dstate, jnp.stack([n, jnp.zeros_like(n), jnp.zeros_like(n)])
    return plain

  def speculative(state, dstate):
    stats = RoundStats.zeros(state.last.shape[0], width)
    carry, v = run_round(spec, inp, Carry(state=state, dstate=dstate, stats=stats), host_draft=host_draft)
    return carry.state, carry.dstate, jnp.stack([v.n_out, v.n_verified, v.n_accepted])
  return speculative


@functools.partial(jax.jit, static_argnames=("spec", "rounds_max", "masks"), donate_argnames=("state", "dstate"))
def run_rounds(spec, params, dparams, state, dstate, rows, sampling, dp, stop_ids, max_new, n_rounds,
               draft_tokens=None, draft_lengths=None, *, rounds_max, masks=None):
  """Up to `n_rounds` (<= rounds_max) rounds over the slots `rows` [b] (None: every slot), ending
  early once all of them are done (a slot stops at its stop token or max_new inside the loop, as
  the round's emission does, while the others go on). The rows are gathered into a batch-b state,
  advanced and written back, so a few live slots run a batch-b program. Rounds: the device
  drafter's, a plain decoding step (`spec.drafter` None), or one round verifying the host
  drafters' draft (draft_tokens [B, w], draft_lengths [B]). `masks`: `slot_leaves` of state, dstate.
  -> (state, dstate, new tokens [b, rounds_max * (W+1)], counts [3, rounds_max, b] (emitted, draft
  tokens verified, accepted, per round), done [b], rounds run)."""
  full_state, full_dstate = state, dstate
  if rows is not None:
    state, dstate = take_rows(state, rows, masks[0]), take_rows(dstate, rows, masks[1])
    sampling, dp, max_new, draft_tokens, draft_lengths = jax.tree_util.tree_map(
        lambda x: x[rows], (sampling, dp, max_new, draft_tokens, draft_lengths))
  host = None if draft_tokens is None else Draft(tokens=draft_tokens, lengths=draft_lengths)
  width = spec.stats_width if host is None else draft_tokens.shape[1]     # tokens a round emits, at most, - 1
  inp = RoundInputs(params=params, dparams=dparams, sampling=sampling, dp=dp, stop_ids=stop_ids, max_new=max_new)
  step = _one_round(spec, inp, host, width)

  def body(c):
    r, state, dstate, counts = c
    state, dstate, n = step(state, dstate)
    return r + 1, state, dstate, counts.at[:, r].set(n.astype(jnp.int32))

  before = state.hist_len
  start = (jnp.int32(0), state, dstate, jnp.zeros((3, rounds_max, state.last.shape[0]), jnp.int32))
  ran, state, dstate, counts = jax.lax.while_loop(lambda c: (c[0] < n_rounds) & ~jnp.all(c[1].done), body, start)
  new, done = new_tokens(before, state, rounds_max * (width + 1)), state.done
  if rows is not None:
    state, dstate = put_rows(full_state, rows, state, masks[0]), put_rows(full_dstate, rows, dstate, masks[1])
  return state, dstate, new, counts, done, ran
