"""The slot engine: with `slot_programs` (its jitted programs), the one place where `specjax.serve`
touches engine internals (the rest speaks only to `SlotEngine`).

Continuous batching runs the engine's own round (`specjax.engine.run_round`: the device drafter's
round, or a round with a host draft; `decode_step_counted` for plain decoding) over a fixed batch
of B slots, and moves single requests in and out of that batch between device calls.

Slots: one `GenState` of batch B (KV cache of capacity C per slot, history of C tokens); a free
or finished slot has `done` set, so the round masks it (it drafts nothing, commits nothing and
emits nothing). Requests join by prefill calls straight into their slots' rows (`joining`,
`slot_programs.prefill_rows`): the requests joining together share each call, their prompt pieces
stacked as one batch (per-row lengths and positions, padded to a few row counts and widths), in
chunks where the drafter allows (the running batch keeps stepping between them; a slot mid-prompt
stays done, so rounds leave it as it is), else the whole prompt in one pass.

A device call (`step`) runs up to `rounds_max` rounds in one `lax.while_loop` (fewer once every
slot in it is done), so one host round trip covers several rounds. The live slots are gathered
into the smallest batch bucket that holds them (padded with free slots), advanced there and
written back, so a lone request runs a batch-1 program rather than B rows; every bucket is one
compiled program per round width. Host drafters draft on the host, so their calls run one round.

With adaptive drafting (`adaptive_slots.SlotWidthController` for chains,
`adaptive_tree_slots.SlotBudgetController` for trees: node budgets) every call runs at the width the
controller plans: one compiled round per width of `AdaptiveConfig.widths_for(K)`, width 0 being
the plain decoding step for plain-compatible drafters (`commit_free` device drafters, host
drafters), plain decoding steps with the drafter caught up once per chunk for drafters whose commit
takes them (`chunk_commit`: `engine.plain_chunks`), and a round that verifies no draft, but keeps
the drafter's state current, for the others.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import DraftParams, check_drafter
from specjax.engine import RoundSpec, plain_chunks
from specjax.engine.generation import GenState, round_up, target_of
from specjax.engine.packed_tree import PackedTree
from specjax.engine.adaptive_tree import PAST_PATH
from specjax.engine.sampling import SamplingParams
from specjax.serve import joining as joins
from specjax.serve import slot_programs as programs
from specjax.serve.adaptive_slots import SlotWidthController
from specjax.serve.adaptive_tree_slots import SlotBudgetController
from specjax.serve.joining import CHUNK_BUCKET, Joining


def compile_ahead(lowerings: list, threads: int | None = None) -> dict:
  """Compile the programs of `lowerings` (callables returning a `jax.stages.Lowered`) `threads` at
  a time: each is traced here, in order, and its XLA compilation (most of the time on a GPU, and
  free of the interpreter lock) runs in a worker while the next is traced. A jitted function then
  called with the same arguments finds its program compiled; nothing runs on the device. A progress
  bar counts the compiled programs (minutes on a GPU for a server's ~30).
  -> {"programs", "trace_s" (tracing and lowering, on this thread), "wall_s"}."""
  from tqdm import tqdm
  threads = threads or min(8, os.cpu_count() or 1)
  t0, traced, jobs = time.perf_counter(), 0.0, []
  with tqdm(total=len(lowerings), desc="compile serving programs", unit="program", leave=False) as bar, \
       ThreadPoolExecutor(max(1, threads), thread_name_prefix="specjax-compile") as pool:
    for lower in lowerings:
      t = time.perf_counter()
      lowered = lower()
      traced += time.perf_counter() - t
      jobs.append(pool.submit(lowered.compile))
      jobs[-1].add_done_callback(lambda _: bar.update())
    for job in jobs:
      job.result()
  return {"programs": len(lowerings), "trace_s": round(traced, 2), "wall_s": round(time.perf_counter() - t0, 2)}


@jax.jit
def _timing_copy(state, dstate):
  """Copies of the slot batch and the drafter state, in one program (the rounds timed on them
  donate them), every slot marked not done: a call whose slots are all done (free slots are) ends
  before its first round."""
  state, dstate = jax.tree_util.tree_map(jnp.copy, (state, dstate))
  return dataclasses.replace(state, done=jnp.zeros_like(state.done)), dstate


@dataclasses.dataclass
class RoundOut:
  """What one call of rounds did, per slot, on the host ([B] arrays: slots outside the call's
  bucket emitted nothing)."""
  tokens: np.ndarray     # [B, J] new tokens (the first n_new of each row are valid)
  n_new: np.ndarray      # [B] tokens emitted over the call's rounds
  done: np.ndarray       # [B] bool slot finished (stop token or budget)
  emitted: np.ndarray    # [R, B] tokens emitted at each round run (0: the slot was not live then)
  drafted: np.ndarray    # [R, B] draft tokens verified (0: speculation off or nothing drafted)
  accepted: np.ndarray   # [R, B] draft tokens accepted
  width: int = 0         # the rounds' verification width (0: plain decoding steps or rounds without drafts)
  batch: int = 0         # the bucket the rounds ran in (slots gathered)
  ranks: np.ndarray | None = None   # [R, B, D] tree rounds under adaptive node budgets: the accepted path's
                                    # node ranks (`adaptive_tree.ranks_on_path`); else D = 0
  shadow: np.ndarray | None = None  # [2, R, B] plain chunks' shadow drafts (draft positions observed, accepted)
                                    # at each chunk's first round, not verified (`slot_programs.run_rounds`)

  @property
  def rounds(self) -> int:
    return self.emitted.shape[0]


def default_buckets(slots: int) -> tuple[int, ...]:
  """Batch sizes the rounds compile for: 1, 8, 32, 128, ... up to half the slots (a bucket copies
  its rows out of the slot batch and back, which pays only when it is much smaller), and every slot."""
  sizes = [1] + [8 * 4 ** i for i in range(8)]
  return tuple(sorted({n for n in sizes if n <= slots // 2} | {slots}))


class SlotEngine:
  """B slots of one target (+ one speculator, or none) and the operations the scheduler needs:
  `begin_join` / `plan_prefill` / `prefill` (joining), `first_tokens`, `finish` and `step` (rounds)."""

  def __init__(self, target, drafter=None, *, slots: int, capacity: int, chunk: int = 256,
               stop_ids=(), rollback: str = "per_step", host_drafter_factory=None, adaptive=None,
               buckets: tuple[int, ...] | None = None, rounds_per_call: int = 8,
               compile_threads: int | None = None):
    """`adaptive`: an `AdaptiveConfig` (adaptive drafting over the live batch) or None (every
    round at the drafter's width). `buckets`: batch sizes the live slots are gathered into (the
    smallest that holds them runs; `default_buckets`); `rounds_per_call`: the most rounds one
    device call runs (`step`; host drafters run one); `compile_threads`: XLA compilations `warm`
    runs at once (None: up to 8, one per CPU core)."""
    self.params, self.cfg = target.params, target.cfg
    self.drafter = None if drafter is None else check_drafter(drafter)
    self.b, self.capacity, self.chunk = slots, capacity, max(round_up(chunk, CHUNK_BUCKET), CHUNK_BUCKET)
    self.buckets = tuple(sorted({min(int(n), slots) for n in (buckets or default_buckets(slots)) if n >= 1} | {slots}))
    self.prefill_buckets = joins.prefill_buckets(slots)
    self.width_cap = capacity           # the widest prefill piece: a slot's cache and history rows
    self.rounds_max = 1 if drafter is not None and not drafter.on_device else max(1, int(rounds_per_call))
    self.rollback = rollback
    self.compile_threads = compile_threads
    self.stop = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
    self.host_factory = host_drafter_factory
    self.host = [None] * slots          # per-slot host drafter instances (batch 1 each)
    self.dparams = drafter.params() if drafter is not None and drafter.on_device else ()
    # the weights as the jitted programs take them on every call (one flat tuple: `packed_tree`)
    self._packed = PackedTree.pack(self.params), PackedTree.pack(self.dparams)
    self._put_cache: dict = {}
    self.control = None
    self.call_fixed_ms = 0.0               # a device call's time besides its rounds (`round_costs`)
    self.warm_phases: dict | None = None   # `warm`'s time by phase, once it has run
    # width-0 calls start each plain chunk with a shadow draft the controller learns from
    self.shadow = (adaptive is not None and adaptive.shadow_drafts and drafter is not None and drafter.on_device
                   and not drafter.replayable and plain_chunks.supports(RoundSpec(cfg=self.cfg, drafter=drafter, width=0)))
    if adaptive is not None and drafter is not None:
      if drafter.proposes_tree and not drafter.on_device:
        raise ValueError("adaptive node budgets need a device tree drafter (its rounds report the path's ranks)")
      controller = SlotBudgetController if drafter.proposes_tree else SlotWidthController
      self.control = controller(adaptive, slots, drafter, rounds_per_call=self.rounds_max, shadowed=self.shadow)
    self._init_batch()

  @property
  def max_draft(self) -> int:
    return 0 if self.drafter is None else self.drafter.max_draft

  @property
  def max_tokens_per_round(self) -> int:
    """The most tokens a round emits per slot: the accepted draft plus one (trees: their depth
    bound plus one, not their node budget)."""
    return RoundSpec(cfg=self.cfg, drafter=self.drafter).stats_width + 1

  @property
  def chunked(self) -> bool:
    """Device drafters that read the prompt pass's features prefill in one pass (their init sees
    the whole prompt); plain decoding, host drafters and stateless device drafters prefill in chunks."""
    d = self.drafter
    return d is None or not d.on_device or (d.commit_free and not d.taps)

  def _init_batch(self):
    """All slots free: an empty batch-B state and drafter state, and which of their leaves have
    the slot axis (against the same built at batch 1, shapes only)."""
    self.dtype = jax.tree_util.tree_leaves(self.params)[0].dtype
    self.state, self.dstate = self._blank(self.b)
    one = jax.eval_shape(lambda: self._blank(1))
    self._masks = (programs.slot_leaves(self.state, one[0]), programs.slot_leaves(self.dstate, one[1]))
    b = self.b
    self.sampling = np.zeros((b,), np.float32), np.zeros((b,), np.int32), np.ones((b,), np.float32)
    self.dp = {"n_max": np.zeros((b,), np.int32), "n_min": np.zeros((b,), np.int32),
               "p_min": np.zeros((b,), np.float32)}
    self.max_new = np.ones((b,), np.int32)
    self.live = np.zeros((b,), bool)   # host copy of ~done for the slots (buckets and adaptive drafting read it)
    self.step_seconds: dict[str, float] = {}    # `step`'s time by part since `take_step_seconds`
    self._dev = None      # device copies of the per-slot parameters (rebuilt when they change)
    self._joined = []     # ([(slot, row)], first tokens, done) of prefill calls since `first_tokens`

  def _blank(self, b: int):
    """(GenState, drafter state) of b free slots (the drafter's shaped by a dummy prefill)."""
    cache = target_of(self.cfg).init_state(self.cfg, b, self.capacity, self.dtype)
    z = lambda: jnp.zeros((b,), jnp.int32)       # distinct buffers: the batch state is donated
    state = GenState(cache=cache, history=jnp.zeros((b, self.capacity), jnp.int32), hist_len=z(),
                     prompt_len=z(), last=z(), keys=jnp.zeros((b, 2), jnp.uint32), done=jnp.ones((b,), bool))
    dstate = ()
    if self.drafter is not None and self.drafter.on_device:
      toks = jnp.zeros((b, CHUNK_BUCKET), jnp.int32)
      lens = jnp.ones((b,), jnp.int32)
      _, tapped, _ = target_of(self.cfg).forward(self.params, self.cfg, toks, cache, n_new=lens,
                                                 taps=self.drafter.taps, last_only=True)
      dstate = self.drafter.init(self.dparams, toks, lens, tapped, self.capacity)
    return state, dstate

  def begin_join(self, prompt: list[int], *, slot: int, draft: DraftParams, temperature=0.0, top_k=0, top_p=1.0,
                 seed=0, max_new=16) -> Joining:
    """A request's joining record for `slot`, with its draft parameters (n_max 0 = no speculation);
    nothing runs yet."""
    k = self.max_draft
    draft = DraftParams(n_max=min(int(draft.n_max), k), n_min=min(int(draft.n_min), k), p_min=draft.p_min)
    return joins.make_joining(prompt, slot=slot, draft=draft, temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=seed, max_new=max_new)

  @property
  def _piece_limit(self) -> int | None:
    return self.chunk if self.chunked else None

  def plan_prefill(self, joining: list[Joining], budget: int, force: bool = True) -> tuple[list[Joining], int]:
    """The joining requests the next prefill call takes within `budget` tokens of work (rows
    bucket x widest piece; `joining.plan`) -> (requests, work)."""
    return joins.plan(joining, budget, chunk=self._piece_limit, buckets=self.prefill_buckets, force=force,
                      grain=self.chunk, cap=self.width_cap)

  def prefill(self, joining: list[Joining]) -> list[Joining]:
    """One prefill call: the next piece of every request of `joining`, stacked as one batch and
    written into their slots. Returns the requests whose prompt ended (now in their slots, with
    their draft parameters). Nothing waits for the call: the first tokens are read with the next
    call's outputs (`first_tokens`), so the host queues the prefill and the rounds back to back."""
    limit = self._piece_limit
    width = max(joins.piece_width(j.piece(limit), self.chunk, self.width_cap) for j in joining)
    finished = self._prefill_call(joining, joins.rows_bucket(len(joining), self.prefill_buckets), width)
    for j in joining:
      j.offset += j.piece(limit)
    for j in finished:
      self._seat(j)
    return finished

  def _prefill_args(self, joining: list[Joining], rows: int, width: int) -> tuple[tuple, dict]:
    """The arguments of `prefill_rows` over `joining` padded to `rows` rows and `width`."""
    # chunked: the history row is capacity-wide, so one program per (rows, width) serves every prompt
    batch, sampling = joins.stack(joining, rows, width, chunk=self._piece_limit, slots=self.b,
                                  prompt_width=self.capacity if self.chunked else width)
    return ((*self._packed, self.state, self.dstate, batch, sampling, self.stop),
            dict(cfg=self.cfg, drafter=self.drafter, capacity=self.capacity, masks=self._masks))

  def _prefill_call(self, joining: list[Joining], rows: int, width: int):
    """`prefill_rows` over `joining` padded to `rows` rows and `width` -> the requests it finishes."""
    args, kw = self._prefill_args(joining, rows, width)
    batch = args[4]
    self.state, self.dstate, first, done = programs.prefill_rows(*args, **kw)
    finished = [j for j, f in zip(joining, batch.finish) if f]
    if finished:
      self._joined.append(([(j.slot, i) for i, j in enumerate(joining) if batch.finish[i]], first, done))
    return finished

  def _seat(self, j: Joining) -> None:
    """The host side of a request whose prompt is in its slot: its sampling and draft parameters,
    its host drafter, and the slot live (a request done at its first token is masked by its state
    until `first_tokens` reads it)."""
    slot = j.slot
    for arr, val in zip(self.sampling, j.sampling[:3]):
      arr[slot] = val
    for name, arr in j.draft.arrays(1, self.max_draft).items():
      self.dp[name][slot] = arr[0]
    self.max_new[slot] = j.max_new
    self._dev = None
    if self.drafter is not None and not self.drafter.on_device:
      self.host[slot] = self.host_factory()
      self.host[slot].begin([j.prompt.tolist()])
    self.live[slot] = True
    if self.control is not None:
      self.control.join(slot, len(j.prompt) + 1)      # the prefill emits one token

  def first_tokens(self) -> list[tuple[int, int, bool]]:
    """(slot, first token, done at it) of every request whose prompt ended since the last call, in
    one transfer; a slot done at its first token is no longer live."""
    joined, self._joined = self._joined, []
    if not joined:
      return []
    got = jax.device_get([(first, done) for _, first, done in joined])
    out = [(slot, int(first[row]), bool(done[row])) for (pairs, _, _), (first, done) in zip(joined, got)
           for slot, row in pairs]
    for slot, _, done in out:
      self.live[slot] &= not done
    return out

  def warm(self, prefill_tokens: int | None = None) -> None:
    """Compile now, so that no request waits for a compilation: the prefill calls (every rows
    bucket and piece width whose work is within `prefill_tokens`, default the chunk per round of a
    call of `rounds_max` rounds, the scheduler's default budget; one row at every width: the
    widths up to the chunk, and past it the one-pass widths of `joining.piece_widths`), the rounds
    of every bucket and width and freeing slots; with adaptive
    drafting time the round of every width (the controller's first costs). No slot changes (the
    calls' rows are all padding, the freed mask empty). The prefill and round programs are
    compiled first, `compile_threads` at a time (`compile_ahead`), then each is called once."""
    most = prefill_tokens or self.chunk * self.rounds_max
    widths = joins.piece_widths(self.chunk, self.width_cap)
    prefills = [(rows, width) for width in (widths if not self.chunked else [w for w in widths if w <= self.chunk])
                for rows in self.prefill_buckets if rows == 1 or rows * width <= most]
    rounds = [(width, None if n == self.b else np.arange(n, dtype=np.int32))
              for width in self._widths() for n in self.buckets]
    t0 = time.perf_counter()
    ahead = compile_ahead([functools.partial(self._lower_prefill, r, w) for r, w in prefills]
                          + [functools.partial(self._lower_round, w, r) for w, r in rounds], self.compile_threads)
    t1 = time.perf_counter()
    for rows, width in prefills:                # each finds its program compiled; no slot changes
      self._prefill_call([], rows, width)
    self.state = programs.finish_rows(self.state, np.zeros((self.b,), bool))
    jax.block_until_ready(self.state)
    t2 = time.perf_counter()
    if self.control is not None:
      self.control.set_costs(self.round_costs(), self.call_fixed_ms)
      self.control.compile(self.state.history, self.state.hist_len)
    t3 = time.perf_counter()
    for width, rows in rounds:
      self._compile(width, rows)
    # where the warm-up's time went (bench-serve prints it): compile_ahead's programs, tracing and
    # wall time, then the first calls of the prefill and round programs, and the controller's timing
    self.warm_phases = {**(ahead or {}), "prefill_calls_s": round(t2 - t1, 2),
                        "round_costs_s": round(t3 - t2, 2), "round_calls_s": round(time.perf_counter() - t3, 2),
                        "total_s": round(time.perf_counter() - t0, 2)}

  def _lower_prefill(self, rows: int, width: int):
    args, kw = self._prefill_args([], rows, width)
    return programs.prefill_rows.lower(*args, **kw)

  def _lower_round(self, width: int | None, rows):
    args, kw = self._round_args(*self._compile_inputs(width), rows, 0)
    return programs.run_rounds.lower(*args, **kw)

  def _compile_inputs(self, width: int | None) -> tuple[RoundSpec, tuple, tuple | None]:
    """(spec, inputs, draft) of the call `_compile(width, rows)` makes: as `_run` would at `width`
    with the requests' n_max, or a host drafter's verification of an empty draft `width` wide."""
    if self.drafter is not None and not self.drafter.on_device and width:
      draft = (jnp.zeros((self.b, width), jnp.int32), jnp.zeros((self.b,), jnp.int32))
      return RoundSpec(cfg=self.cfg, rollback=self.rollback), self._device_params(), draft
    return (*self._device_round(width, self.dp["n_max"]), None)

  def _device_round(self, width: int | None, lengths: np.ndarray) -> tuple[RoundSpec, tuple]:
    """(spec, inputs) of a round drafted on the device (or a plain step) at `width` with per-slot
    draft limits `lengths` [B] (passed only under adaptive drafting; else the cached n_max)."""
    inputs = self._device_params()
    if self.drafter is None or (not width and not self.drafter.on_device):
      return RoundSpec(cfg=self.cfg, rollback=self.rollback), inputs
    if self.control is not None and (width or not self.shadow):   # a shadow draft drafts the requests' n_max
      sampling, dp, max_new = inputs
      inputs = sampling, {**dp, "n_max": self._on_device(np.asarray(lengths, np.int32))}, max_new
    return self._spec(width), inputs

  def _compile(self, width: int | None, rows) -> None:
    """Compile the call of rounds at `width` over `rows` by running none of its rounds."""
    spec, inputs, draft = self._compile_inputs(width)
    self._call(spec, rows, 0, width or 0, inputs, draft)

  def _widths(self) -> list:
    """The widths rounds run at: the adaptive controller's, a host drafter's verification widths
    (0 and powers of two up to K), else the drafter's own (None: plain decoding)."""
    if self.drafter is None:
      return [None]
    if self.control is not None:
      return list(self.control.widths)
    if not self.drafter.on_device:
      return [0] + sorted({min(1 << i, self.max_draft) for i in range(self.max_draft.bit_length())})
    return [self.max_draft]

  def finish(self, slots: list[int]) -> None:
    """Free slots (finished, cancelled or disconnected): masked from the next round on."""
    if not len(slots):
      return
    mask = np.zeros((self.b,), bool)
    mask[slots] = True
    self.state = programs.finish_rows(self.state, mask)
    self.live[slots] = False
    for s in slots:
      self.host[s] = None

  def _on_device(self, x):
    """Small call input `x` (rows, a round count, draft limits) as a device array, kept for the next
    call with the same value: a host array is put on the device on every call, which on one slot
    costs about what a round of SmolLM2 does (`experiments/serve_call_cost.py`)."""
    if x is None:
      return None
    x = np.asarray(x)
    key = (x.shape, x.dtype.str, x.tobytes())
    got = self._put_cache.get(key)
    if got is None:
      if len(self._put_cache) >= 512:
        self._put_cache.clear()
      got = self._put_cache[key] = jax.device_put(np.array(x))
    return got

  def _device_params(self):
    if self._dev is None:
      t, k, p = self.sampling
      host = SamplingParams(t, k, p, np.zeros((self.b,), np.uint32)), self.dp, self.max_new
      self._dev = jax.device_put(jax.tree_util.tree_map(np.copy, host))   # copies: the host arrays change in place
    return self._dev

  def bucket_size(self) -> int:
    """The batch bucket the next call runs in: the smallest that holds the live slots."""
    n_live = int(np.count_nonzero(self.live))
    return next(size for size in self.buckets if size >= n_live)

  def bucket_rows(self) -> np.ndarray | None:
    """The slots the next call runs: the live ones, padded with free slots to the smallest bucket
    that holds them ([b] int32), or None when that bucket is every slot."""
    live = np.flatnonzero(self.live)
    n = self.bucket_size()
    if n == self.b:
      return None
    return np.concatenate([live, np.flatnonzero(~self.live)[:n - len(live)]]).astype(np.int32)

  def step(self, rounds: int = 1) -> RoundOut:
    """Up to `rounds` rounds (at most `rounds_max`) over the live slots in one device call, ending
    early once every slot is done: at the drafter's width, or at the width and draft lengths the
    adaptive controller plans from the live slots (one plan for the call's rounds)."""
    t_start = time.perf_counter()
    rows = self.bucket_rows()
    rounds = max(1, min(int(rounds), self.rounds_max))
    if self.control is None:
      out = self._run(None if self.drafter is None else self.max_draft, self.dp["n_max"], rows, rounds)
    else:
      if self.control.costs is None:           # not warmed: time every width now (compiles them)
        self.control.set_costs(self.round_costs(), self.call_fixed_ms)
      bucket = None if rows is None else len(rows)
      plan = self.control.plan(self.dp["n_max"], self.dp["n_min"], self.live.copy(), rounds=rounds, bucket=bucket)
      t0 = time.perf_counter()
      out = self._run(plan.width, plan.lengths, rows, plan.rounds)
      ms = self._round_ms((time.perf_counter() - t0) * 1e3, out.rounds)
      t_obs = time.perf_counter()
      for r in range(out.rounds):
        self.control.observe(plan, out.width, out.drafted[r], out.accepted[r], out.emitted[r] > 0, ms,
                             self.state.history, self.state.hist_len, bucket=bucket, ranks=out.ranks[r],
                             shadow=None if out.shadow is None else out.shadow[:, r])
      self._add_seconds("observe", time.perf_counter() - t_obs)
    self.live &= ~out.done
    self._add_seconds("step", time.perf_counter() - t_start)
    return out

  def _add_seconds(self, part: str, seconds: float) -> None:
    self.step_seconds[part] = self.step_seconds.get(part, 0.0) + seconds

  def take_step_seconds(self) -> dict[str, float]:
    """Seconds spent in `step` since the last take, by part: "call" (the jitted call of rounds until
    it returns), "fetch" (its outputs to the host), "observe" (the adaptive controller's updates)
    and "step" (all of `step`; the rest of it is planning, gathering rows, host drafting and
    assembling the outputs)."""
    out, self.step_seconds = self.step_seconds, {}
    return out

  def _run(self, width: int | None, lengths: np.ndarray, rows, rounds: int) -> RoundOut:
    """`rounds` rounds at `width` over `rows` with per-slot draft limits `lengths` [B] (the requests'
    own n_max without adaptive drafting, whose device arrays are cached)."""
    if self.drafter is not None and not self.drafter.on_device and width:
      return self._host_round(self._device_params(), lengths, rows, rounds)
    spec, inputs = self._device_round(width, lengths)
    return self._call(spec, rows, rounds, width or 0, inputs)

  def _round_args(self, spec: RoundSpec, inputs, draft, rows, rounds: int) -> tuple[tuple, dict]:
    """The arguments of one `run_rounds` call."""
    sampling, dp, max_new = inputs
    draft = draft or (None, None)
    return ((spec, *self._packed, self.state, self.dstate, self._on_device(rows), sampling, dp, self.stop, max_new,
             self._on_device(np.int32(rounds)), *draft),
            dict(rounds_max=1 if draft[0] is not None else self.rounds_max, masks=None if rows is None else self._masks,
                 ranks=isinstance(self.control, SlotBudgetController),      # the path's ranks only where read
                 shadow=self.shadow and spec.width == 0))

  def _call(self, spec: RoundSpec, rows, rounds: int, width: int, inputs, draft=None) -> RoundOut:
    """One `run_rounds` call; its outputs on the host as [B] arrays (slots outside `rows`: nothing emitted)."""
    args, kw = self._round_args(spec, inputs, draft, rows, rounds)
    t0 = time.perf_counter()
    self.state, self.dstate, new, counts, done, ran, ranks = programs.run_rounds(*args, **kw)
    t1 = time.perf_counter()
    new, counts, done, ran, ranks = jax.device_get((new, counts, done, ran, ranks))
    self._add_seconds("call", t1 - t0)
    self._add_seconds("fetch", time.perf_counter() - t1)
    counts, ranks = counts[:, :int(ran)], ranks[:int(ran)]
    if rows is None:
      return RoundOut(new, counts[0].sum(axis=0), done, *counts[:3], width=width, batch=self.b, ranks=ranks,
                      shadow=counts[3:] if len(counts) > 3 else None)
    full_new = np.zeros((self.b, new.shape[1]), new.dtype)
    full_counts = np.zeros(counts.shape[:2] + (self.b,), counts.dtype)
    full_ranks = np.full((ranks.shape[0], self.b, ranks.shape[2]), PAST_PATH, ranks.dtype)
    full_done = ~self.live
    full_new[rows], full_counts[:, :, rows], full_done[rows], full_ranks[:, rows] = new, counts, done, ranks
    return RoundOut(full_new, full_counts[0].sum(axis=0), full_done, *full_counts[:3], width=width, batch=len(rows),
                    ranks=full_ranks, shadow=full_counts[3:] if len(full_counts) > 3 else None)

  def _spec(self, width: int) -> RoundSpec:
    """The device drafter's round at `width` (its full width: the spec of the fixed loop)."""
    return RoundSpec(cfg=self.cfg, drafter=self.drafter, rollback=self.rollback,
                     width=None if width >= self.max_draft else width)

  def _host_round(self, inputs, lengths, rows, rounds: int) -> RoundOut:
    """A round of per-slot host drafters: each drafts up to `lengths` [B] for its own slot, one
    jitted verification as wide as the longest draft (a plain step when no slot drafted). `rounds`
    0 only compiles (nothing drafts)."""
    k = self.max_draft
    toks, lens = np.zeros((self.b, k), np.int32), np.zeros((self.b,), np.int32)
    if rounds and np.any(lengths > 0):
      hist, hl = jax.device_get((self.state.history, self.state.hist_len))
      for i, d in enumerate(self.host):
        if d is not None and lengths[i] > 0:
          t, n, _ = d.propose([hist[i, :hl[i]].tolist()], np.asarray([lengths[i]]))
          n = min(int(np.asarray(n)[0]), int(lengths[i]))
          toks[i, :n], lens[i] = np.asarray(t).reshape(-1)[:n], n
    if not lens.any():
      out = self._call(RoundSpec(cfg=self.cfg, rollback=self.rollback), rows, min(rounds, 1), 0, inputs)
    else:
      width = min(k, 1 << int(max(int(lens.max()), 1) - 1).bit_length())
      out = self._call(RoundSpec(cfg=self.cfg, rollback=self.rollback), rows, 1, width, inputs,
                       draft=(toks[:, :width], lens))
    if out.rounds:
      for i, d in enumerate(self.host):
        if d is not None:
          d.accept(out.accepted[0, i:i + 1], verified=out.drafted[0, i:i + 1] > 0)
    return out

  def _round_ms(self, call_ms: float, rounds: int) -> float:
    """A call's ms per round without the call's fixed cost (at least a tenth of its time per round)."""
    return max(call_ms - self.call_fixed_ms, 0.1 * call_ms) / max(rounds, 1)

  def round_costs(self, repeats: int = 3) -> np.ndarray:
    """[W] median ms per round at each of the adaptive controller's widths, the call's fixed cost
    apart, which it sets as `call_fixed_ms`. Calls of `rounds_max` rounds (a host drafter's calls
    run one) over every slot of a copy of the slot batch, after one untimed call that compiles each;
    then calls of one round at the first width: a call of R rounds takes F + R c, one of a round
    F + c, so F = (R T1 - TR) / (R - 1). Every slot drafts its n_max, up to the width (host drafters:
    empty drafts); `_timing_copy` marks the copy's slots not done and the timed calls lift every
    slot's token budget, else a free slot would end the call after one round.

    The controller compares widths at their cost per round plus F over the planned call's rounds,
    and the server's calls are measured the same way (`_round_ms`): how many rounds a call runs is
    the scheduler's choice (joins, waiting requests, the call budget), not the width's, so a width
    that happened to run in short calls must not look dearer for it, nor one the server has not run
    (priced by this warm-up alone) cheaper or dearer than the widths it runs."""
    saved, dev = (self.state, self.dstate), self._device_params()
    sampling, dp, max_new = dev
    # no slot stops on its budget; put as `_device_params` puts its arrays (the round programs' input layout)
    self._dev = sampling, dp, jax.device_put(np.full(np.shape(self.max_new), self.capacity, np.int32))

    def timed(width: int, rounds: int, n: int) -> tuple[float, int]:
      """Median ms of `n` calls of `rounds` rounds at `width` (each on a fresh copy: a timed call
      may end its slots), and the rounds the last one ran."""
      times, ran = [], 0
      for _ in range(n):
        self.state, self.dstate = _timing_copy(*saved)
        jax.block_until_ready((self.state, self.dstate))
        t0 = time.perf_counter()
        ran = self._timed_round(width, rounds)
        times.append((time.perf_counter() - t0) * 1e3)
      return float(np.median(times)), ran

    calls = []
    try:
      for w in self.control.widths:
        timed(w, self.rounds_max, 1)                        # compiles it
        calls.append(timed(w, self.rounds_max, repeats))
      many, r = calls[0]
      one, _ = timed(self.control.widths[0], 1, repeats) if r > 1 else (many, 1)
      self.call_fixed_ms = max(0.0, (r * one - many) / (r - 1)) if r > 1 else 0.0
    finally:
      self.state, self.dstate = saved
      self._dev = dev
    return np.asarray([self._round_ms(ms, ran) for ms, ran in calls], np.float32)

  def _timed_round(self, width: int, rounds: int = 1) -> int:
    """A call of up to `rounds` rounds at `width` without host drafting (host drafters' programs are
    the verification of an empty draft of that width, one round a call), waited for (its outputs
    are fetched). -> the rounds it ran."""
    if self.drafter.on_device:
      return self._run(width, np.minimum(self.dp["n_max"], width), None, rounds).rounds
    inputs = self._device_params()
    if width == 0:
      return self._call(RoundSpec(cfg=self.cfg, rollback=self.rollback), None, 1, 0, inputs).rounds
    return self._call(RoundSpec(cfg=self.cfg, rollback=self.rollback), None, 1, width, inputs,
                      draft=(jnp.zeros((self.b, width), jnp.int32), jnp.zeros((self.b,), jnp.int32))).rounds
