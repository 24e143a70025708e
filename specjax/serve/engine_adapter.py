"""The one module of `specjax.serve` that touches engine internals.

Continuous batching runs the engine's own round (`specjax.engine.run_round`: the device drafter's
round, or a round with a host draft; `decode_step_counted` for plain decoding) over a fixed batch of B slots, and moves
single requests in and out of that batch between rounds. Everything else in `specjax.serve`
speaks only to `SlotEngine`, so when the engine's API changes, this file is the one to change.

Slots: one `GenState` of batch B (KV cache of capacity C per slot, history of C tokens); a free
or finished slot has `done` set, so the round masks it (it drafts nothing, commits nothing and
emits nothing). A request joins by a batch-1 prefill (in chunks, so the running batch keeps
stepping between them) whose state is scattered into the free slot by one jitted update.

With adaptive drafting (`adaptive_slots.SlotWidthController`) every round runs at the width the
controller plans: one compiled round per width of `AdaptiveConfig.widths_for(K)`, width 0 being
the plain decoding step for plain-compatible drafters (`commit_free` device drafters, host
drafters) and a round that verifies no draft, but keeps the drafter's state current, for the others.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import Draft, DraftParams, check_drafter
from specjax.engine import Carry, RoundInputs, RoundSpec, run_round
from specjax.engine.decode import decode_step_counted
from specjax.engine.generation import GenState, emit, round_up, target_of
from specjax.engine.sampling import SamplingParams, init_keys, sample, shaped_probs, split_keys
from specjax.engine.stats import RoundStats
from specjax.serve.adaptive_slots import SlotWidthController

CHUNK_BUCKET = 64      # prefill chunks are padded to a multiple of this (few compiled widths)


@dataclasses.dataclass
class RoundOut:
  """What one round did, per slot, on the host."""
  tokens: np.ndarray     # [B, J] new tokens (the first n_new of each row are valid)
  n_new: np.ndarray      # [B] tokens emitted this round
  done: np.ndarray       # [B] bool slot finished (stop token or budget)
  drafted: np.ndarray    # [B] draft tokens verified (0: speculation off or nothing drafted)
  accepted: np.ndarray   # [B] draft tokens accepted
  width: int = 0         # the round's verification width (0: a plain decoding step or a round without drafts)


@dataclasses.dataclass
class Joining:
  """A request being prefilled into a private batch-1 state, one chunk at a time."""
  prompt: np.ndarray     # [T] int32
  sampling: SamplingParams   # batch 1
  max_new: int
  offset: int = 0        # prompt tokens already in the cache
  cache: object = None   # batch-1 target state


def _scatter(big, small, slot):
  """Write batch-1 leaf `small` into row `slot` of `big` (leaves without a batch axis, e.g. a
  drafter's shared table or a scalar, keep the running batch's value)."""
  if big.ndim == 0 or small.ndim == 0 or small.shape[0] != 1 or big.shape[1:] != small.shape[1:]:
    return big
  return big.at[slot].set(small[0])


@functools.partial(jax.jit, donate_argnames=("state", "dstate"))
def _insert(state, dstate, slot, state1, dstate1):
  """The running batch with slot `slot` replaced by a freshly prefilled request."""
  state = jax.tree_util.tree_map(lambda b, s: _scatter(b, s, slot), state, state1)
  dstate = jax.tree_util.tree_map(lambda b, s: _scatter(b, s, slot), dstate, dstate1)
  return state, dstate


@functools.partial(jax.jit, donate_argnames=("state",))
def _finish(state, mask):
  """Mark slots done (cancelled or left): the round masks them from now on."""
  return dataclasses.replace(state, done=state.done | mask)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _prefill_chunk(params, cache, tokens, n, *, cfg):
  """Write one prompt chunk [1, P] (n valid tokens) into a batch-1 cache."""
  _, _, cache = target_of(cfg).forward(params, cfg, tokens, cache, n_new=n)
  return cache


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "history_len", "capacity"))
def _prefill_last(params, dparams, cache, tokens, n, full_prompt, prompt_len, sampling, stop_ids, max_new, *,
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


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def _plain_step(params, state, sampling, stop_ids, max_new, *, cfg):
  """One plain decoding step over every slot."""
  state, n_out = decode_step_counted(params, cfg, state, sampling, stop_ids, max_new)
  return state, state.history, n_out


def _new_tokens(state_before_len, state, width):
  """[B, width] history entries appended by the last round."""
  cols = state_before_len[:, None] + jnp.arange(width)[None, :]
  return jnp.take_along_axis(state.history, jnp.minimum(cols, state.history.shape[1] - 1), axis=1)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state", "dstate"))
def _round_step(spec, params, dparams, state, dstate, sampling, dp, stop_ids, max_new, draft_tokens=None,
                draft_lengths=None):
  """One speculative round over every slot (`run_round`): the device drafter's, or with the host
  drafters' draft (tokens [B, w], lengths [B]) when given.
  -> (state, dstate, new tokens [B, W+1], emitted [B], draft tokens verified [B], accepted [B])."""
  inp = RoundInputs(params=params, dparams=dparams, sampling=sampling, dp=dp, stop_ids=stop_ids, max_new=max_new)
  host = None if draft_tokens is None else Draft(tokens=draft_tokens, lengths=draft_lengths)
  width = spec.stats_width if host is None else draft_tokens.shape[1]
  before = state.hist_len
  carry, v = run_round(spec, inp, Carry(state=state, dstate=dstate, stats=RoundStats.zeros(state.last.shape[0], width)),
                       host_draft=host)
  new = _new_tokens(before, carry.state, width + 1)
  return carry.state, carry.dstate, new, carry.state.hist_len - before, v.n_verified, v.n_accepted


class SlotEngine:
  """B slots of one target (+ one speculator, or none) and the operations the scheduler needs:
  `begin_join` / `prefill_step` (chunked prefill), `insert`, `finish` and `step` (one round)."""

  def __init__(self, target, drafter=None, *, slots: int, capacity: int, chunk: int = 256,
               stop_ids=(), rollback: str = "per_step", host_drafter_factory=None, adaptive=None):
    """`adaptive`: an `AdaptiveConfig` (adaptive drafting over the live batch) or None (every
    round at the drafter's width)."""
    self.params, self.cfg = target.params, target.cfg
    self.drafter = None if drafter is None else check_drafter(drafter)
    self.b, self.capacity, self.chunk = slots, capacity, max(round_up(chunk, CHUNK_BUCKET), CHUNK_BUCKET)
    self.rollback = rollback
    self.stop = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
    self.host_factory = host_drafter_factory
    self.host = [None] * slots          # per-slot host drafter instances (batch 1 each)
    self.dparams = drafter.params() if drafter is not None and drafter.on_device else ()
    self.control = None
    if adaptive is not None and drafter is not None:
      if drafter.proposes_tree:
        raise ValueError("adaptive drafting picks chain lengths; a tree drafter sets its own node budget")
      self.control = SlotWidthController(adaptive, slots, drafter)
    self._init_batch()

  @property
  def max_draft(self) -> int:
    return 0 if self.drafter is None else self.drafter.max_draft

  @property
  def chunked(self) -> bool:
    """Device drafters that read the prompt pass's features prefill in one pass (their init sees
    the whole prompt); plain decoding, host drafters and stateless device drafters prefill in chunks."""
    d = self.drafter
    return d is None or not d.on_device or (d.commit_free and not d.taps)

  def _init_batch(self):
    """All slots free: an empty batch-B state (and drafter state, shaped by a dummy prefill)."""
    b = self.b
    dtype = jax.tree_util.tree_leaves(self.params)[0].dtype
    cache = target_of(self.cfg).init_state(self.cfg, b, self.capacity, dtype)
    z = lambda: jnp.zeros((b,), jnp.int32)       # distinct buffers: the batch state is donated
    self.state = GenState(cache=cache, history=jnp.zeros((b, self.capacity), jnp.int32), hist_len=z(),
                          prompt_len=z(), last=z(), keys=jnp.zeros((b, 2), jnp.uint32), done=jnp.ones((b,), bool))
    self.dstate = ()
    if self.drafter is not None and self.drafter.on_device:
      toks = jnp.zeros((b, CHUNK_BUCKET), jnp.int32)
      lens = jnp.ones((b,), jnp.int32)
      _, tapped, _ = target_of(self.cfg).forward(self.params, self.cfg, toks, cache, n_new=lens,
                                                 taps=self.drafter.taps, last_only=True)
      self.dstate = self.drafter.init(self.dparams, toks, lens, tapped, self.capacity)
    self.sampling = np.zeros((b,), np.float32), np.zeros((b,), np.int32), np.ones((b,), np.float32)
    self.dp = {"n_max": np.zeros((b,), np.int32), "n_min": np.zeros((b,), np.int32),
               "p_min": np.zeros((b,), np.float32)}
    self.max_new = np.ones((b,), np.int32)
    self.live = np.zeros((b,), bool)   # host copy of ~done for the slots (adaptive drafting reads it)
    self._dev = None      # device copies of the per-slot parameters (rebuilt when they change)

  def begin_join(self, prompt: list[int], *, temperature=0.0, top_k=0, top_p=1.0, seed=0, max_new=16) -> Joining:
    """A request's private prefill state (nothing runs yet)."""
    sampling = SamplingParams.make(1, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    dtype = jax.tree_util.tree_leaves(self.params)[0].dtype
    cache = target_of(self.cfg).init_state(self.cfg, 1, self.capacity, dtype)
    return Joining(prompt=np.asarray(prompt, np.int32), sampling=sampling, max_new=int(max_new), cache=cache)

  def prefill_step(self, j: Joining):
    """Run the next chunk of `j`'s prompt. Returns None while chunks remain, then (state1, dstate1)."""
    rest = len(j.prompt) - j.offset
    if self.chunked and rest > self.chunk:
      toks = jnp.asarray(j.prompt[None, j.offset:j.offset + self.chunk])
      j.cache = _prefill_chunk(self.params, j.cache, toks, jnp.asarray([self.chunk], jnp.int32), cfg=self.cfg)
      j.offset += self.chunk
      return None
    width = round_up(rest, CHUNK_BUCKET)
    toks = np.zeros((1, width), np.int32)
    toks[0, :rest] = j.prompt[j.offset:]
    # chunked: the history row is capacity-wide, so one program per last-chunk width serves every prompt
    full = np.zeros((1, self.capacity if self.chunked else width), np.int32)
    full[0, :len(j.prompt)] = j.prompt
    return _prefill_last(self.params, self.dparams, j.cache, jnp.asarray(toks), jnp.asarray([rest], jnp.int32),
                         jnp.asarray(full), jnp.asarray([len(j.prompt)], jnp.int32), j.sampling, self.stop,
                         jnp.asarray([j.max_new], jnp.int32), cfg=self.cfg, drafter=self.drafter,
                         history_len=self.capacity, capacity=self.capacity)

  def insert(self, slot: int, j: Joining, prefilled, *, draft: DraftParams) -> tuple[int, bool]:
    """Put a prefilled request into `slot` with its draft parameters (n_max 0 = no speculation).
    Returns (its first token, whether it is already done)."""
    state1, dstate1 = prefilled
    self.state, self.dstate = _insert(self.state, self.dstate, jnp.int32(slot), state1, dstate1)
    s = j.sampling
    for arr, val in zip(self.sampling, (s.temperature, s.top_k, s.top_p)):
      arr[slot] = np.asarray(val)[0]
    k = self.max_draft
    for name, arr in DraftParams(n_max=min(int(draft.n_max), k), n_min=min(int(draft.n_min), k),
                                 p_min=draft.p_min).arrays(1, k).items():
      self.dp[name][slot] = arr[0]
    self.max_new[slot] = j.max_new
    self._dev = None
    if self.drafter is not None and not self.drafter.on_device:
      self.host[slot] = self.host_factory()
      self.host[slot].begin([j.prompt.tolist()])
    first, done, hist_len = jax.device_get((state1.last[0], state1.done[0], state1.hist_len[0]))
    self.live[slot] = not done
    if self.control is not None:
      self.control.join(slot, int(hist_len))
    return int(first), bool(done)

  def warm(self) -> None:
    """Compile the prefill programs (every last-chunk width up to the chunk, and a full chunk) now,
    so a server's first requests do not pay for them, and with adaptive drafting the round of every
    width (timed: the controller's first costs); the slot batch is untouched."""
    widths = range(CHUNK_BUCKET, self.chunk + 1, CHUNK_BUCKET) if self.chunked else [CHUNK_BUCKET]
    lengths = list(widths) + ([self.chunk + 1] if self.chunked and self.chunk + 1 < self.capacity // 2 else [])
    for n in lengths:
      j = self.begin_join([0] * n, max_new=1)
      while (out := self.prefill_step(j)) is None:
        pass
      jax.block_until_ready(out)
    if self.control is not None:
      self.control.set_costs(self.round_costs())
      self.control.compile(self.state.history, self.state.hist_len)

  def finish(self, slots: list[int]) -> None:
    """Free slots (finished, cancelled or disconnected): masked from the next round on."""
    mask = np.zeros((self.b,), bool)
    mask[slots] = True
    self.state = _finish(self.state, jnp.asarray(mask))
    self.live[slots] = False
    for s in slots:
      self.host[s] = None

  def _device_params(self):
    if self._dev is None:
      t, k, p = self.sampling
      self._dev = (SamplingParams(jnp.asarray(t), jnp.asarray(k), jnp.asarray(p), jnp.zeros((self.b,), jnp.uint32)),
                   {n: jnp.asarray(a) for n, a in self.dp.items()}, jnp.asarray(self.max_new))
    return self._dev

  def step(self) -> RoundOut:
    """One round over every slot (done slots masked): at the drafter's width, or at the width and
    draft lengths the adaptive controller plans from the live slots."""
    if self.control is None:
      out = self._round(None if self.drafter is None else self.max_draft, self.dp["n_max"])
    else:
      if self.control.costs is None:           # not warmed: time every width now (compiles them)
        self.control.set_costs(self.round_costs())
      live = self.live.copy()
      plan = self.control.plan(self.dp["n_max"], self.dp["n_min"], live)
      t0 = time.perf_counter()
      out = self._round(plan.width, plan.lengths)
      self.control.observe(plan, out.width, out.drafted, out.accepted, live, (time.perf_counter() - t0) * 1e3,
                           self.state.history, self.state.hist_len)
    self.live &= ~out.done
    return out

  def _round(self, width: int | None, lengths: np.ndarray) -> RoundOut:
    """One round at `width` with per-slot draft limits `lengths` [B] (the requests' own n_max
    without adaptive drafting, whose device arrays are cached)."""
    sampling, dp, max_new = self._device_params()
    if self.drafter is None or (width == 0 and not self.drafter.on_device):
      return self._plain(sampling, max_new)
    if not self.drafter.on_device:
      return self._host_step(sampling, dp, max_new, lengths)
    if self.control is not None:
      dp = {**dp, "n_max": jnp.asarray(lengths, jnp.int32)}
    self.state, self.dstate, new, n_new, drafted, accepted = _round_step(
        self._spec(width), self.params, self.dparams, self.state, self.dstate, sampling, dp, self.stop, max_new)
    new, n_new, drafted, accepted, done = jax.device_get((new, n_new, drafted, accepted, self.state.done))
    return RoundOut(new, n_new, done, drafted, accepted, width=width)

  def _spec(self, width: int) -> RoundSpec:
    """The device drafter's round at `width` (its full width: the spec of the fixed loop)."""
    return RoundSpec(cfg=self.cfg, drafter=self.drafter, rollback=self.rollback,
                     width=None if width >= self.max_draft else width)

  def _plain(self, sampling, max_new) -> RoundOut:
    """One plain decoding step over every slot."""
    before = np.asarray(self.state.hist_len)
    self.state, hist, n_new = _plain_step(self.params, self.state, sampling, self.stop, max_new, cfg=self.cfg)
    n_new, done, hist = jax.device_get((n_new, self.state.done, hist))
    toks = hist[np.arange(self.b), np.minimum(before, hist.shape[1] - 1)][:, None]
    zeros = np.zeros((self.b,), np.int32)
    return RoundOut(toks, n_new, done, zeros, zeros, width=0)

  def _host_step(self, sampling, dp, max_new, lengths) -> RoundOut:
    """A round of per-slot host drafters: each drafts up to `lengths` [B] for its own slot, one
    jitted verification as wide as the longest draft (a plain step when no slot drafted)."""
    k = self.max_draft
    toks, lens = np.zeros((self.b, k), np.int32), np.zeros((self.b,), np.int32)
    if np.any(lengths > 0):
      hist, hl = jax.device_get((self.state.history, self.state.hist_len))
    for i, d in enumerate(self.host):
      if d is not None and lengths[i] > 0:
        t, n, _ = d.propose([hist[i, :hl[i]].tolist()], np.asarray([lengths[i]]))
        n = min(int(np.asarray(n)[0]), int(lengths[i]))
        toks[i, :n], lens[i] = np.asarray(t).reshape(-1)[:n], n
    if not lens.any():
      out = self._plain(sampling, max_new)
    else:
      width = min(k, 1 << int(max(int(lens.max()), 1) - 1).bit_length())
      self.state, _, new, n_new, dlen, n_acc = _round_step(
          RoundSpec(cfg=self.cfg, rollback=self.rollback), self.params, (), self.state, (), sampling, dp, self.stop,
          max_new, jnp.asarray(toks[:, :width]), jnp.asarray(lens))
      n_acc, dlen, new, n_new, done = jax.device_get((n_acc, dlen, new, n_new, self.state.done))
      out = RoundOut(np.asarray(new), n_new, done, dlen, n_acc, width=width)
    for i, d in enumerate(self.host):
      if d is not None:
        d.accept(out.accepted[i:i + 1], verified=out.drafted[i:i + 1] > 0)
    return out

  def round_costs(self, repeats: int = 3) -> np.ndarray:
    """[W] median ms of a round at each of the adaptive controller's widths, run on a copy of the
    slot batch (every slot drafting its n_max, up to the width; host drafters with empty drafts)
    after one untimed round that compiles it. The controller's first estimate: what the server's
    rounds then take replaces it."""
    saved = self.state, self.dstate
    ms = []
    try:
      for w in self.control.widths:
        self.state, self.dstate = jax.tree_util.tree_map(jnp.copy, saved)
        times = []
        for i in range(repeats + 1):
          jax.block_until_ready((self.state, self.dstate))
          t0 = time.perf_counter()
          self._timed_round(w)
          times.append((time.perf_counter() - t0) * 1e3)
        ms.append(float(np.median(times[1:])))
    finally:
      self.state, self.dstate = saved
    return np.asarray(ms, np.float32)

  def _timed_round(self, width: int) -> None:
    """A round at `width` without host drafting (host drafters' programs are the verification of
    an empty draft of that width), waited for."""
    if self.drafter.on_device:
      self._round(width, np.minimum(self.dp["n_max"], width))
      return
    sampling, dp, max_new = self._device_params()
    if width == 0:
      self._plain(sampling, max_new)
      return
    self.state, *rest = _round_step(RoundSpec(cfg=self.cfg, rollback=self.rollback), self.params, (), self.state, (),
                                    sampling, dp, self.stop, max_new, jnp.zeros((self.b, width), jnp.int32),
                                    jnp.zeros((self.b,), jnp.int32))
    jax.block_until_ready(rest)
