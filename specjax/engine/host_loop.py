"""The host loop for host drafters (n-gram maps, suffix trees): the drafter proposes on the host
from Python token lists, one jitted `run_round` verifies and accepts, and the accepted tokens go
back to the drafter. Verification widths are powers of two up to K, so few programs compile.

Under adaptive drafting, when the controller asks no sequence for a draft, the next rounds run as
plain decoding steps in one device call (`loops.plain_rounds`): a host round costs a device call
and a wait, several times a decoding step for a small model, so backing off round by round would
not back off to plain decoding's speed. The host loop explores with shadow drafts: with each
plain segment (`AdaptiveConfig.shadow_rounds` rounds) the drafter proposes as for a round from the
tokens before it, while the device runs the segment, and its draft, never verified, is compared
with the tokens the segment makes, so the controller learns what drafting would accept without
paying a host round for it. The drafter's request begins (`begin`) at its first use, after the
first segment is dispatched, so its setup overlaps the device too."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import Draft
from specjax.engine import adaptive as adapt
from specjax.engine.loops import plain_rounds, plain_segment, prefill_request
from specjax.engine.packed_tree import PackedTree, unpack
from specjax.engine.round import Carry, RoundInputs, RoundSpec, run_round
from specjax.engine.stats import RoundStats


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("carry",))
def host_step(spec: RoundSpec, inp: RoundInputs, carry: Carry, draft_tokens, draft_lengths):
  """One round with the host's draft (tokens [B, w], lengths [B]).
  -> (carry, accepted [B], verified draft length [B], new tokens [B, w+1], emitted [B], done [B]).
  `inp`'s params / dparams may be `PackedTree`s (the host loop's: cheaper to pass every round)."""
  inp = dataclasses.replace(inp, params=unpack(inp.params), dparams=unpack(inp.dparams))
  before = carry.state.hist_len
  carry, v = run_round(spec, inp, carry, host_draft=Draft(tokens=draft_tokens, lengths=draft_lengths))
  history = carry.state.history
  cols = before[:, None] + jnp.arange(draft_tokens.shape[1] + 1)[None, :]
  new_tokens = jnp.take_along_axis(history, jnp.minimum(cols, history.shape[1] - 1), axis=1)
  return carry, v.n_accepted, v.n_verified, new_tokens, v.n_out, carry.state.done


def _pow2_width(n: int, k: int) -> int:
  return min(k, 1 << int(max(n, 1) - 1).bit_length())


def _warm_widths(spec, inp, carry, k, n_max):
  """Compile every verification width now (on throwaway copies), so timed runs never compile."""
  b, widest, width = carry.state.last.shape[0], _pow2_width(int(np.asarray(n_max).max()), k), 1
  while True:
    w = min(width, widest)
    host_step(spec, inp, jax.tree_util.tree_map(jnp.copy, carry), jnp.zeros((b, w), jnp.int32),
              jnp.zeros((b,), jnp.int32))
    if w >= widest:
      return
    width *= 2


@dataclasses.dataclass
class _Segment:
  """A plain segment on its way: its outputs (device arrays, `loops.plain_segment`), the rounds it
  may run, the sequences live when it was asked for, its shadow draft (tokens [B, K], lengths [B],
  drafted from the tokens before it) and when it was dispatched."""
  out: tuple
  rounds: int
  live: np.ndarray
  t_dispatch: float
  drafted: tuple | None = None


def _finish_segment(seg: _Segment, control, histories, t_free: float) -> tuple[np.ndarray, float, bool]:
  """Wait for a plain segment; its tokens go onto `histories`, its ms per step (from when the
  device was free for it: its dispatch, or the end of the segment queued before it) to the
  controller's costs, and its shadow draft is compared with the tokens it made.
  -> (done [B], when it ended, whether its shadow draft matched a token)."""
  made, n_made, live_after, ran = jax.device_get(seg.out)
  t_end = time.perf_counter()
  control.observe_cost(0, (t_end - max(seg.t_dispatch, t_free)) * 1e3, int(ran))
  control.ran_plain(int(ran) - 1)
  for i, h in enumerate(histories):
    h.extend(made[i, : n_made[i]].tolist())
  if seg.drafted is not None:
    tokens, lengths = seg.drafted
    asked = np.minimum(lengths, n_made)                                            # [B] positions the segment made
    k = tokens.shape[1]                                   # <= the window (`host_loop`)
    hit = (tokens == made[:, :k]) | (np.arange(k)[None, :] >= asked[:, None])
    matched = np.minimum(np.argmin(np.concatenate([hit, np.zeros_like(hit[:, :1])], axis=1), axis=1), asked)
    control.observe_shadow(asked, matched, seg.live & (asked > 0))
    return ~live_after, t_end, bool(np.any(matched[seg.live] > 0))
  return ~live_after, t_end, False     # nothing observed: the controller's next choice cannot change


_PLAIN_MS: dict = {}     # ms per plain decoding step, by shape (`adapt.cost_key`)


def _plain_step_ms(spec, inp, carry, key, short: int = 2, long: int = 10) -> float | None:
  """ms per plain decoding step at this shape, the difference of a long and a short plain segment
  run on copies of the state with the token budget lifted (compiles `plain_rounds`, which backing
  off runs; a benchmark's short warm-up caches it for the timed runs); cached per shape. None when
  the cache has no room for the long segment."""
  if key in _PLAIN_MS:
    return _PLAIN_MS[key]
  state = carry.state
  room = min(int(state.cache.capacity) - int(jnp.max(state.cache.lengths)),
             int(state.history.shape[1]) - int(jnp.max(state.hist_len))) - 2
  if room <= long:
    return None
  lifted = dataclasses.replace(inp, max_new=jnp.full_like(inp.max_new, int(jnp.max(state.n_out)) + long + 1))

  def run(n):
    c = jax.tree_util.tree_map(jnp.copy, carry)
    jax.block_until_ready(c)
    t0 = time.perf_counter()
    out = jax.block_until_ready(plain_rounds(spec, lifted, c, jnp.int32(n)))   # the whole state: on the CPU
    return (time.perf_counter() - t0) * 1e3, int(out[1])                      # a scalar output may be ready first

  run(short)                         # compile
  _PLAIN_MS[key] = float(adapt.per_round_ms([run], short, long)[0])
  return _PLAIN_MS[key]


def host_loop(spec: RoundSpec, inp: RoundInputs, drafter, prompts, tokens, lens, *, capacity, history_len,
              warm_widths=False, adaptive=None, costs=None, marks=None):
  """-> (carry, host drafting seconds, adaptive record or None). `marks`: a dict that gets the time
  the prefill ended ("prefill", waited for)."""
  b, k = len(prompts), drafter.max_draft
  key = adapt.cost_key(inp.params, spec.cfg, b, capacity, ("plain step",))
  carry = prefill_request(spec.prefill_spec(), inp, jnp.asarray(tokens), jnp.asarray(lens), capacity=capacity,
                          history_len=history_len)
  if marks is not None:
    jax.block_until_ready(carry)
    marks["prefill"] = time.perf_counter()
  carry = dataclasses.replace(carry, stats=RoundStats.zeros(b, k))
  n_max, max_new = np.asarray(inp.dp["n_max"]), np.asarray(inp.max_new)
  # one host_step a round: its weights as one flat tuple (flattening nnx Variables costs ~1 ms a call)
  inp = dataclasses.replace(inp, params=PackedTree.pack(inp.params), dparams=PackedTree.pack(inp.dparams))
  control = None
  if adaptive:
    # width 0 runs as plain decoding steps on the device, not as host rounds: its cost is a step's
    plain_ms = _plain_step_ms(spec, inp, carry, key) if adaptive.costs is None else None
    control = adapt.HostController(adaptive, b, k, costs, plain_ms=plain_ms, shadow=True)
  # tokens a plain segment returns: its most rounds, and at least a shadow draft's K to compare with
  window = max(control.max_plain_rounds, k) if control is not None else 0
  if warm_widths:
    _warm_widths(spec, inp, carry, k, n_max)
    if control is not None:   # a later run may back off to plain rounds where the warm-up's few tokens did not
      plain_segment(spec, inp, jax.tree_util.tree_map(jnp.copy, carry), jnp.int32(0), window=window)
  first = np.asarray(carry.state.last)
  histories = [list(p) + [int(first[i])] for i, p in enumerate(prompts)]
  done = np.asarray(carry.state.done)
  begun = False

  def begin():
    """The drafter's request begins at its first use: after a plain segment is on its way, so that
    its setup (a suffix drafter's tries of the prompts and of earlier outputs) overlaps the device."""
    nonlocal begun
    if not begun:
      drafter.begin([list(p) for p in prompts])
      begun = True

  def shadow_draft(live):    # a draft not verified: compared with what the segment makes
    begin()
    s_tok, s_len, _ = drafter.propose(histories, control.shadow_lengths(n_max, live))
    return np.asarray(s_tok, np.int32).reshape(b, -1), np.minimum(np.asarray(s_len, np.int32), n_max)

  # Plain segments are pipelined while the shadow drafts match nothing: the next one is queued
  # behind the one on the device before the host waits for that one, so the device does not idle
  # while the host reads a segment's tokens, compares its shadow draft and drafts the next. The
  # controller then decides one segment behind (the tokens of the segment on the device are not in
  # `histories` yet); once a shadow draft matches, drafting may pay soon, and the host waits for
  # each segment before deciding, so it turns to drafting without that lag.
  draft_seconds, pending, t_free, matching = 0.0, None, 0.0, True    # the first segment is waited for

  def finish():
    """Wait for the pending segment and take in its tokens."""
    nonlocal done, t_free, matching, pending
    done, t_free, matching = _finish_segment(pending, control, histories, t_free)
    pending = None

  while not (done.all() and pending is None):
    t0 = time.perf_counter()
    if pending is not None and matching:
      finish()
      continue
    remaining = max_new - np.asarray([len(h) - len(p) for h, p in zip(histories, prompts)])
    live = ~done
    if pending is not None:
      remaining = remaining - pending.rounds              # what is left after the segment on the device
      live = live & (remaining > 0)
      if not live.any():                                  # all done once it is: nothing more to queue
        finish()
        continue
    asked = np.where(done, 0, n_max) if control is None else control.lengths(n_max, live, np.maximum(remaining, 1))
    if control is not None and not asked.any():
      rounds = min(control.plain_rounds_ahead(), window)
      carry, out = plain_segment(spec, inp, carry, jnp.int32(rounds), window=window)   # queued, not waited for
      seg = _Segment(out=out, rounds=rounds, live=live, t_dispatch=time.perf_counter())
      if pending is not None:
        finish()
      if control.shadow:
        t_s = time.perf_counter()
        seg.drafted = shadow_draft(seg.live)        # from the tokens before `seg`, while the device runs it
        draft_seconds += time.perf_counter() - t_s
      begin()
      drafter.accept(np.zeros(b, np.int32), verified=np.zeros(b, bool))
      pending = seg
      continue
    if pending is not None:    # a drafted round needs the tokens so far: the segment first, then decide again
      finish()
      control.retract()
      continue
    begin()
    d_tok, d_len, _ = drafter.propose(histories, asked)
    draft_seconds += time.perf_counter() - t0
    d_len = np.minimum(np.asarray(d_len, np.int32), np.minimum(n_max, asked))
    width = _pow2_width(int(d_len.max()), k)      # verify only as wide as this round's longest draft
    d_tok = np.asarray(d_tok, np.int32).reshape(b, -1)[:, :width]
    carry, *out = host_step(spec, inp, carry, jnp.asarray(d_tok), jnp.asarray(d_len))
    live = ~done
    n_acc, dlen, new_tokens, n_new, done = jax.device_get(out)      # one wait for all five
    if control is not None:
      control.observe(dlen, n_acc, live)
    t1 = time.perf_counter()
    drafter.accept(n_acc, verified=dlen > 0)   # a draft cut by n_min was not rejected, just not verified
    for i in range(b):
      histories[i].extend(new_tokens[i, : n_new[i]].tolist())
    t2 = time.perf_counter()
    draft_seconds += t2 - t1
    if control is not None:
      control.observe_cost(width, (t2 - t0) * 1e3)
  begin()
  drafter.end(histories)        # e.g. the suffix drafter's global tree learns the final tokens
  return carry, draft_seconds, None if control is None else control.record()
