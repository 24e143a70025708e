"""Continuous batching: requests join free slots between rounds and leave when they finish.

One background thread owns the device and runs `Scheduler._run`: it admits waiting requests
into free slots, prefills them within a budget (so the running batch keeps stepping), runs one
device call of rounds over the live slots, and hands each request its new tokens. Requests talk
to it only through thread-safe queues: `submit` enqueues, `cancel` asks the loop to free the
slot, and each request's `sink` receives events (token lists, then a final event).
A joining request's first token is read with the call's outputs (one transfer per iteration, no
wait per join), and delivered before the tokens of its first rounds.

A call runs up to the engine's `rounds_max` rounds, so that one host round trip, one pass of
bookkeeping and one event per request cover several rounds; requests join between calls, so a
call runs one round while a prompt is prefilled in chunks, and while requests wait for a slot it
ends where the first running request is expected to end. A request that arrives during a call waits for it
to end (at most `rounds_max` rounds); one cancelled during a call loses at most that call's
tokens. The bookkeeping of a call is array arithmetic over the slots (per-slot counters, read
into a request's usage when it ends), and an iteration's events reach each asyncio loop in one
thread-safe call (`LoopSink`).

Prefill budget: requests joining together are prefilled together, their prompt pieces stacked in
one engine call (`SlotEngine.prefill`; a piece is at most one chunk where the drafter allows
chunks, else the whole prompt). A call's work is the tokens its program computes, rows bucket x
widest piece (`joining.plan`). Between two calls of rounds the scheduler runs prefill calls, the
joining requests in arrival order, while their work stays within `prefill_budget` tokens per
round of the call that follows once they have joined (default: one chunk per round, times the
engine's `rounds_max`, or the rounds that fit `call_ms`); the first call of an iteration always
runs (at least its first request), so a prompt longer than the budget still progresses. Budgeting
by the next call's rounds rather than the last call's matters when many requests arrive at once:
the calls that run while requests join are one round long, and a budget of one chunk per round of
those would admit a few prompts per iteration, each paying a whole call's fixed cost for a round.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import itertools
import threading
import time
from typing import Callable

import numpy as np

from specjax.drafters.base import DraftParams
from specjax.serve.engine_adapter import SlotEngine

RATE_ROUNDS = 4     # rounds a slot runs before its own tokens per round predict when its request ends


class QueueFull(Exception):
  """More requests are waiting than the server accepts (HTTP 429)."""


@dataclasses.dataclass
class GenRequest:
  """One request as the scheduler sees it: token ids and per-request parameters."""
  prompt: list[int]
  max_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  speculative: bool = True
  n_max: int | None = None       # None = the drafter's width
  n_min: int = 0
  p_min: float = 0.0


class LoopSink:
  """A request's events into `queue`, an asyncio queue of `loop`, from any thread."""

  def __init__(self, loop, queue):
    self.loop, self.queue = loop, queue

  def __call__(self, event: dict) -> None:
    self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def _put_all(items) -> None:
  for queue, event in items:
    queue.put_nowait(event)


def publish(events: list[tuple[Callable, dict]]) -> None:
  """Hand events to their sinks: those of `LoopSink`s in one thread-safe call per event loop (one
  wake-up of the loop per iteration, not one per request), other sinks called directly."""
  by_loop: dict = {}
  for sink, event in events:
    if isinstance(sink, LoopSink):
      by_loop.setdefault(sink.loop, []).append((sink.queue, event))
    else:
      sink(event)
  for loop, items in by_loop.items():
    loop.call_soon_threadsafe(_put_all, items)


@dataclasses.dataclass
class SpecUsage:
  """Per-request speculation counters (reported in the response's `usage`)."""
  enabled: bool = False
  rounds: int = 0
  drafted: int = 0
  accepted: int = 0
  emitted: int = 0
  accepted_by_position: list[int] = dataclasses.field(default_factory=list)
  drafted_by_position: list[int] = dataclasses.field(default_factory=list)

  def as_dict(self) -> dict:
    tau = self.emitted / self.rounds if self.rounds else 0.0
    rate = [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]
    return {"enabled": self.enabled, "rounds": self.rounds, "draft_tokens": self.drafted,
            "accepted_tokens": self.accepted, "tau": round(tau, 4),
            "acceptance_by_position": [round(r, 4) for r in rate]}


class SlotCounters:
  """Per-slot speculation counters of the running requests ([B] arrays, [B, W] by draft position),
  advanced by every call of rounds at once and read into a request's `SpecUsage` when it ends."""

  def __init__(self, slots: int, width: int):
    self.width = width
    self.rounds, self.drafted, self.accepted, self.emitted = (np.zeros(slots, np.int64) for _ in range(4))
    self.drafted_by_pos, self.accepted_by_pos = (np.zeros((slots, width), np.int64) for _ in range(2))

  def add(self, emitted: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
    """A call's rounds: emitted, drafted, accepted [R, B] (a slot emits in every round it is live)."""
    pos = np.arange(self.width)
    self.rounds += (emitted > 0).sum(axis=0)
    self.emitted += emitted.sum(axis=0)
    self.drafted += drafted.sum(axis=0)
    self.accepted += accepted.sum(axis=0)
    self.drafted_by_pos += (drafted[:, :, None] > pos).sum(axis=0)
    self.accepted_by_pos += (accepted[:, :, None] > pos).sum(axis=0)

  def usage(self, slot: int, usage: "SpecUsage") -> None:
    """Copy slot `slot`'s counters into `usage`."""
    usage.rounds, usage.emitted = int(self.rounds[slot]), int(self.emitted[slot])
    usage.drafted, usage.accepted = int(self.drafted[slot]), int(self.accepted[slot])
    if usage.rounds:
      usage.drafted_by_position = self.drafted_by_pos[slot].tolist()
      usage.accepted_by_position = self.accepted_by_pos[slot].tolist()

  def reset(self, slot: int) -> None:
    for a in (self.rounds, self.drafted, self.accepted, self.emitted, self.drafted_by_pos, self.accepted_by_pos):
      a[slot] = 0


@dataclasses.dataclass(eq=False)
class Handle:
  """A submitted request: its id, parameters, event sink and counters."""
  id: int
  request: GenRequest
  sink: Callable[[dict], None]
  usage: SpecUsage
  submitted: float = dataclasses.field(default_factory=time.perf_counter)
  n_out: int = 0
  slot: int | None = None
  finished: bool = False


class Scheduler:
  """Fixed slots over one `SlotEngine`, fed by a bounded waiting queue."""

  def __init__(self, engine: SlotEngine, *, max_queue: int = 64, prefill_budget: int | None = None,
               metrics=None, stop_ids=(), call_ms: float | None = None):
    """`call_ms`: a device call's time budget in ms (None: none, every call may run the engine's
    most rounds); see `_next_rounds`."""
    if call_ms is not None and not call_ms > 0:
      raise ValueError(f"call_ms must be > 0 (or None), got {call_ms!r}")
    self.engine = engine
    self.max_queue = max_queue
    self.prefill_budget = prefill_budget or engine.chunk   # prefill work (tokens computed) per round of the next call
    self.call_ms = call_ms
    self._round_ms: dict[int, float] = {}                  # batch bucket -> ms per round of its calls, host included
    self.metrics = metrics
    self.stop_ids = set(stop_ids)
    self._waiting: collections.deque[Handle] = collections.deque()
    self._joining: list[tuple[Handle, object]] = []
    self._slots: list[Handle | None] = [None] * engine.b
    self._counters = SlotCounters(engine.b, engine.max_draft)
    self._cancel: set[Handle] = set()
    self._lock = threading.Lock()
    self._wake = threading.Condition(self._lock)
    self._ids = itertools.count()
    self._live: dict[int, Handle] = {}       # submitted and not yet ended
    self._outbox: list[tuple[Callable, dict]] = []   # this iteration's events, published at its end
    self._stop = False
    self._thread: threading.Thread | None = None
    self.error: BaseException | None = None

  def warm(self) -> None:
    """Compile every program serving can call (`SlotEngine.warm`), prefill calls up to the most
    work this scheduler gives one: its budget per round times the most rounds of a call."""
    self.engine.warm(self.prefill_budget * self.engine.rounds_max)
    self.engine.take_step_seconds()          # the warm-up's calls are not serving's
    # What startup built (the weights' wrappers, compiled programs, the tokenizer: ~0.4M objects
    # with SmolLM2, a full collection ~0.12 s) leaves the cyclic collector's generations, so a
    # collection while serving scans only what serving allocates, not the process (as vLLM does).
    gc.collect()
    gc.freeze()

  # --- called from request handlers (any thread) ------------------------------------------------

  def submit(self, req: GenRequest, sink: Callable[[dict], None]) -> Handle:
    """Queue a request; its events go to `sink` (called on the model thread; a `LoopSink` gets
    them through its loop). QueueFull when full."""
    with self._lock:
      if len(self._waiting) >= self.max_queue:
        raise QueueFull(f"{len(self._waiting)} requests are waiting (limit {self.max_queue}); retry later")
      h = Handle(next(self._ids), req, sink, SpecUsage(enabled=req.speculative and self.engine.max_draft > 0))
      self._waiting.append(h)
      self._live[h.id] = h
      self._wake.notify()
    return h

  def cancel(self, h: Handle) -> None:
    """Stop generating for `h` (client gone, stop string seen): its slot frees before the next call."""
    with self._lock:
      if not h.finished:
        self._cancel.add(h)
        self._wake.notify()

  def queue_length(self) -> int:
    return len(self._waiting)

  def running(self) -> int:
    return sum(h is not None for h in self._slots)

  def start(self) -> "Scheduler":
    self._thread = threading.Thread(target=self._run, name="specjax-model-loop", daemon=True)
    self._thread.start()
    return self

  def stop(self) -> None:
    with self._lock:
      self._stop = True
      self._wake.notify()
    if self._thread is not None:
      self._thread.join(timeout=30)

  @property
  def healthy(self) -> bool:
    return self.error is None and self._thread is not None and self._thread.is_alive()

  # --- the model thread -------------------------------------------------------------------------

  def _run(self) -> None:
    try:
      while True:
        with self._lock:
          while not (self._stop or self._waiting or self._joining or self._cancel or self.running()):
            self._wake.wait()
          if self._stop:
            break
        self._iteration()
    except BaseException as e:   # the loop must not die silently: /health reports it, requests end
      self.error = e
      for h in list(self._live.values()):
        self._end(h, "error", error=f"{type(e).__name__}: {e}")
      self._publish()
      raise

  def _iteration(self) -> None:
    """Cancellations, then admissions (bounded prefill), then one call of rounds over the live
    slots; the iteration's events are published together at its end."""
    t_start = time.perf_counter()
    self._apply_cancellations()
    t_admit = time.perf_counter()
    self._admit()
    t0 = time.perf_counter()
    out, seconds = None, 0.0
    if self.running():
      out = self.engine.step(self._next_rounds())
      seconds = time.perf_counter() - t0
      self._observe_call(out.batch, seconds, out.rounds)
    self._first_tokens()
    if out is not None:
      self._dispatch(out, seconds)
    self._publish()
    if self.metrics is not None:
      self.metrics.set_load(len(self._waiting), self.running())
      prefill = t0 - t_admit
      self.metrics.thread_time(seconds, prefill, time.perf_counter() - t_start - seconds - prefill)
      self.metrics.step_time(self.engine.take_step_seconds())

  def _next_rounds(self) -> int:
    """One round while requests are joining (their next prefill calls run between calls of rounds);
    while requests wait for a slot, the rounds until the first running request is expected to end
    (`_expected_rounds_left`), so that a waiting request takes its slot then; else the engine's
    most. With `call_ms`, never more rounds than fit the budget at the running cost of a round in
    the bucket the call runs in (`_rounds_in_budget`)."""
    most = self._rounds_in_budget(self.engine.rounds_max)
    if self._joining:
      return 1
    if self._waiting:
      return max(1, min(most, self._expected_rounds_left()))
    return most

  def _expected_rounds_left(self) -> int:
    """The fewest rounds any running request needs to reach its token budget, at the tokens per
    round its slot has emitted so far (once it has run `RATE_ROUNDS` rounds; before that, the
    running slots' pooled figure, or the most a round emits when no slot has one). Counting every
    round at the most a round can emit would, for a speculator, end calls after a round or two
    whenever a request waits (each call paying its fixed cost), and the requests that end in
    between would join one at a time, each in a prefill call of its own."""
    slots = np.array([i for i, h in enumerate(self._slots) if h is not None], np.int64)
    if slots.size == 0:
      return 1
    left = np.array([self._slots[i].request.max_tokens - self._slots[i].n_out for i in slots], np.float64)
    rounds, emitted = self._counters.rounds[slots], self._counters.emitted[slots]
    top = float(self.engine.max_tokens_per_round)
    pooled = emitted.sum() / rounds.sum() if rounds.sum() else top
    rate = np.where(rounds >= RATE_ROUNDS, emitted / np.maximum(rounds, 1), pooled)
    rate = np.clip(rate, 1.0, top)
    return int(np.min(np.ceil(left / rate)))

  def _rounds_in_budget(self, most: int) -> int:
    """The rounds of a call that fit `call_ms`: a device call has a fixed cost besides its rounds
    (a host round trip, the slots' rows gathered and written back), so more rounds per call make
    each round cheaper, while a request that arrives during a call waits for its end to join. The
    budget bounds that wait. A bucket's first call runs one round; its time per round (the call's
    time over its rounds, so the fixed cost is spread over them) then sets the next call's rounds,
    which lowers the time per round, until the budget or `most` binds."""
    if self.call_ms is None:
      return most
    ms = self._round_ms.get(self.engine.bucket_size())
    return 1 if ms is None else max(1, min(most, int(self.call_ms / ms)))

  def _observe_call(self, bucket: int, seconds: float, rounds: int) -> None:
    """A call of `rounds` rounds in `bucket` took `seconds`: the bucket's running ms per round
    (the latest call weighs half)."""
    if rounds < 1 or self.call_ms is None:
      return
    ms = 1e3 * seconds / rounds
    old = self._round_ms.get(bucket)
    self._round_ms[bucket] = ms if old is None else 0.5 * (old + ms)

  def _publish(self) -> None:
    events, self._outbox = self._outbox, []
    if events:
      publish(events)

  def _apply_cancellations(self) -> None:
    with self._lock:
      gone, self._cancel = self._cancel, set()
      self._waiting = collections.deque(h for h in self._waiting if h not in gone)
    self._joining = [(h, j) for h, j in self._joining if h not in gone]
    freed = [h for h in gone if h.slot is not None and self._slots[h.slot] is h]
    self._free(freed)
    for h in gone:
      if not h.finished:
        self._end(h, "cancelled")

  def _free_slots(self) -> list[int]:
    taken = {h.slot for h, _ in self._joining}
    return [i for i, h in enumerate(self._slots) if h is None and i not in taken]

  def _admit(self) -> None:
    """Start joining for waiting requests while slots are free, then run prefill calls within the
    budget (module docstring): `prefill_budget` tokens of work per round of the call that runs once
    they have joined."""
    free = self._free_slots()
    with self._lock:
      while free and self._waiting:
        h = self._waiting.popleft()
        h.slot = free.pop(0)
        self._joining.append((h, self._begin_join(h)))
    budget, first = self.prefill_budget * self._rounds_in_budget(self.engine.rounds_max), True
    while self._joining:
      batch, work = self.engine.plan_prefill([j for _, j in self._joining], budget, force=first)
      if not batch:
        break
      budget, first = budget - work, False
      done = {id(j) for j in self.engine.prefill(batch)}    # these are in their slots now
      if self.metrics is not None:
        self.metrics.prefilled(len(batch))
      for h, j in self._joining:
        if id(j) in done:
          self._slots[h.slot] = h
          self._counters.reset(h.slot)
      self._joining = [(h, j) for h, j in self._joining if id(j) not in done]

  def _begin_join(self, h: Handle):
    """The engine's joining record of `h` for its slot, with its sampling and draft parameters."""
    r = h.request
    k = self.engine.max_draft
    n_max = 0 if not r.speculative else (k if r.n_max is None else min(r.n_max, k))
    draft = DraftParams(n_max=n_max, n_min=min(r.n_min, n_max), p_min=r.p_min)
    return self.engine.begin_join(r.prompt, slot=h.slot, draft=draft, temperature=r.temperature, top_k=r.top_k,
                                  top_p=r.top_p, seed=r.seed, max_new=r.max_tokens)

  def _first_tokens(self) -> None:
    """Deliver the first token of every request that joined this iteration (before its rounds'
    tokens); one done at it leaves."""
    left, reasons = [], []
    for slot, first, done in self.engine.first_tokens():
      h = self._slots[slot]
      if self.metrics is not None:
        self.metrics.first_token(time.perf_counter() - h.submitted)
      self._deliver(h, [first])
      if done:
        left.append(h)
        reasons.append("stop" if first in self.stop_ids else "length")
    self._leave(left, reasons)

  def _dispatch(self, out, seconds: float) -> None:
    """Hand each running request the tokens of the call's rounds; finished ones leave their slots."""
    self._counters.add(out.emitted, out.drafted, out.accepted)
    if self.metrics is not None:
      self.metrics.rounds_run(out.emitted, out.drafted, out.accepted, seconds, out.width, out.batch)
    left, reasons = [], []
    for i in np.flatnonzero(out.n_new):      # every slot live at the call's start emitted
      h = self._slots[i]
      toks = out.tokens[i, :out.n_new[i]].tolist()
      self._deliver(h, toks)
      if out.done[i]:
        left.append(h)
        reasons.append("stop" if toks and toks[-1] in self.stop_ids else "length")
    self._leave(left, reasons)

  def _deliver(self, h: Handle, tokens: list[int]) -> None:
    h.n_out += len(tokens)
    self._outbox.append((h.sink, {"tokens": tokens}))

  def _free(self, handles: list[Handle]) -> None:
    """Free the slots of `handles` (one engine call), their counters read into their usage."""
    if not handles:
      return
    self.engine.finish([h.slot for h in handles])
    for h in handles:
      self._counters.usage(h.slot, h.usage)
      self._slots[h.slot] = None

  def _leave(self, handles: list[Handle], reasons: list[str]) -> None:
    self._free(handles)
    for h, reason in zip(handles, reasons):
      self._end(h, reason)

  def _end(self, h: Handle, reason: str, error: str | None = None) -> None:
    h.finished = True
    self._live.pop(h.id, None)
    if self.metrics is not None:
      self.metrics.request_done(reason, h.n_out)
    self._outbox.append((h.sink, {"finish_reason": reason, "usage": h.usage.as_dict(), "error": error}))
