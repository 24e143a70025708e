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
from specjax.engine.loops import plain_rounds, prefill_request
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


def _plain_segment(spec, inp, carry, control, histories, done, shadow=None):
  """The rounds up to the controller's next exploring round (with shadow drafts: one shadow
  segment) as plain decoding steps, one device call; the new tokens go onto `histories`, the
  segment's ms per step to the controller's costs. `shadow(live)` (-> draft tokens [B, K], lengths
  [B]) is asked from the histories as they were before the segment but while the device runs it
  (the host's drafting overlaps the device's steps), and its draft is compared with the tokens the
  segment made. -> (carry, done [B], seconds the shadow draft took)."""
  t0 = time.perf_counter()
  live = ~done
  carry, ran = plain_rounds(spec, inp, carry, jnp.int32(control.plain_rounds_ahead()))   # dispatched, not waited for
  drafted, shadow_s = None, 0.0
  if shadow is not None:
    t_s = time.perf_counter()
    drafted = shadow(live)
    shadow_s = time.perf_counter() - t_s
  history, hist_len, done, ran = jax.device_get((carry.state.history, carry.state.hist_len, carry.state.done, ran))
  control.observe_cost(0, (time.perf_counter() - t0) * 1e3, int(ran))
  control.ran_plain(int(ran) - 1)
  before = np.asarray([len(h) for h in histories])
  for i, h in enumerate(histories):
    h.extend(history[i, before[i]: hist_len[i]].tolist())
  if drafted is not None:
    tokens, lengths = drafted
    asked = np.minimum(lengths, hist_len - before)                                 # [B] positions the segment made
    cols = np.minimum(before[:, None] + np.arange(tokens.shape[1])[None, :], history.shape[1] - 1)
    hit = (tokens == np.take_along_axis(history, cols, axis=1)) | (np.arange(tokens.shape[1])[None, :] >= asked[:, None])
    matched = np.minimum(np.argmin(np.concatenate([hit, np.zeros_like(hit[:, :1])], axis=1), axis=1), asked)
    control.observe_shadow(asked, matched, live & (asked > 0))
  return carry, done, shadow_s


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
  if warm_widths:
    _warm_widths(spec, inp, carry, k, n_max)
    if control is not None:   # a later run may back off to plain rounds where the warm-up's few tokens did not
      plain_rounds(spec, inp, jax.tree_util.tree_map(jnp.copy, carry), jnp.int32(0))
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

  draft_seconds = 0.0
  while not done.all():
    t0 = time.perf_counter()
    remaining = max_new - np.asarray([len(h) - len(p) for h, p in zip(histories, prompts)])
    asked = np.where(done, 0, n_max) if control is None else control.lengths(n_max, ~done, remaining)
    if control is not None and not asked.any():
      carry, done, shadow_s = _plain_segment(spec, inp, carry, control, histories, done,
                                             shadow_draft if control.shadow else None)
      begin()
      drafter.accept(np.zeros(b, np.int32), verified=np.zeros(b, bool))
      draft_seconds += shadow_s
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
