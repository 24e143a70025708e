"""Continuous batching: requests join free slots between rounds and leave when they finish.

One background thread owns the device and runs `Scheduler._loop`: it admits waiting requests
into free slots (a bounded amount of chunked prefill per iteration, so the running batch keeps
stepping), runs one round over every slot, and hands each request its new tokens. Requests talk
to it only through thread-safe queues: `submit` enqueues, `cancel` asks the loop to free the slot,
and each request's `sink` callback receives events (token lists, then a final event).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Callable

import numpy as np

from specjax.drafters.base import DraftParams
from specjax.serve.engine_adapter import SlotEngine


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

  def add(self, drafted: int, accepted: int, emitted: int, width: int) -> None:
    if len(self.drafted_by_position) < width:
      self.drafted_by_position = [0] * width
      self.accepted_by_position = [0] * width
    self.rounds += 1
    self.drafted += drafted
    self.accepted += accepted
    self.emitted += emitted
    for i in range(min(drafted, width)):
      self.drafted_by_position[i] += 1
    for i in range(min(accepted, width)):
      self.accepted_by_position[i] += 1

  def as_dict(self) -> dict:
    tau = self.emitted / self.rounds if self.rounds else 0.0
    rate = [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]
    return {"enabled": self.enabled, "rounds": self.rounds, "draft_tokens": self.drafted,
            "accepted_tokens": self.accepted, "tau": round(tau, 4),
            "acceptance_by_position": [round(r, 4) for r in rate]}


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
               metrics=None, stop_ids=()):
    self.engine = engine
    self.max_queue = max_queue
    self.prefill_budget = prefill_budget or engine.chunk   # prompt tokens prefilled per loop iteration
    self.metrics = metrics
    self.stop_ids = set(stop_ids)
    self._waiting: collections.deque[Handle] = collections.deque()
    self._joining: list[tuple[Handle, object]] = []
    self._slots: list[Handle | None] = [None] * engine.b
    self._cancel: set[Handle] = set()
    self._lock = threading.Lock()
    self._wake = threading.Condition(self._lock)
    self._ids = itertools.count()
    self._live: dict[int, Handle] = {}       # submitted and not yet ended
    self._stop = False
    self._thread: threading.Thread | None = None
    self.error: BaseException | None = None

  # --- called from request handlers (any thread) ------------------------------------------------

  def submit(self, req: GenRequest, sink: Callable[[dict], None]) -> Handle:
    """Queue a request; its events go to `sink` (called on the model thread). QueueFull when full."""
    with self._lock:
      if len(self._waiting) >= self.max_queue:
        raise QueueFull(f"{len(self._waiting)} requests are waiting (limit {self.max_queue}); retry later")
      h = Handle(next(self._ids), req, sink, SpecUsage(enabled=req.speculative and self.engine.max_draft > 0))
      self._waiting.append(h)
      self._live[h.id] = h
      self._wake.notify()
    return h

  def cancel(self, h: Handle) -> None:
    """Stop generating for `h` (client gone, stop string seen): its slot frees before the next round."""
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
      raise

  def _iteration(self) -> None:
    """Cancellations, then admissions (bounded prefill), then one round of the running slots."""
    self._apply_cancellations()
    self._admit()
    if self.running():
      t0 = time.perf_counter()
      out = self.engine.step()
      self._dispatch(out, time.perf_counter() - t0)
    if self.metrics is not None:
      self.metrics.set_load(len(self._waiting), self.running())

  def _apply_cancellations(self) -> None:
    with self._lock:
      gone, self._cancel = self._cancel, set()
      self._waiting = collections.deque(h for h in self._waiting if h not in gone)
    self._joining = [(h, j) for h, j in self._joining if h not in gone]
    freed = [h.slot for h in gone if h.slot is not None and self._slots[h.slot] is h]
    if freed:
      self.engine.finish(freed)
    for h in gone:
      if h.slot is not None and self._slots[h.slot] is h:
        self._slots[h.slot] = None
      if not h.finished:
        self._end(h, "cancelled")

  def _free_slots(self) -> list[int]:
    taken = {h.slot for h, _ in self._joining}
    return [i for i, h in enumerate(self._slots) if h is None and i not in taken]

  def _admit(self) -> None:
    """Start prefills for waiting requests while slots are free, then spend the prefill budget."""
    free = self._free_slots()
    with self._lock:
      while free and self._waiting:
        h = self._waiting.popleft()
        h.slot = free.pop(0)
        r = h.request
        self._joining.append((h, self.engine.begin_join(r.prompt, temperature=r.temperature, top_k=r.top_k,
                                                         top_p=r.top_p, seed=r.seed, max_new=r.max_tokens)))
    budget = self.prefill_budget
    while self._joining and budget > 0:
      h, j = self._joining[0]
      before = j.offset
      done = self.engine.prefill_step(j)
      budget -= max(j.offset - before, len(j.prompt) - before if done is not None else 0)
      if done is not None:
        self._joining.pop(0)
        self._join(h, j, done)

  def _join(self, h: Handle, j, prefilled) -> None:
    r = h.request
    k = self.engine.max_draft
    n_max = 0 if not r.speculative else (k if r.n_max is None else min(r.n_max, k))
    first, done = self.engine.insert(h.slot, j, prefilled,
                                     draft=DraftParams(n_max=n_max, n_min=min(r.n_min, n_max), p_min=r.p_min))
    self._slots[h.slot] = h
    if self.metrics is not None:
      self.metrics.first_token(time.perf_counter() - h.submitted)
    self._deliver(h, [first])
    if done:
      self._leave(h, "stop" if first in self.stop_ids else "length")

  def _dispatch(self, out, seconds: float) -> None:
    """Hand each running request its new tokens; finished ones leave their slots."""
    width = self.engine.max_draft
    emitted = 0
    for i, h in enumerate(self._slots):
      if h is None:
        continue
      n = int(out.n_new[i])
      emitted += n
      h.usage.add(int(out.drafted[i]), int(out.accepted[i]), n, width)
      if self.metrics is not None:
        self.metrics.round_of_slot(int(out.drafted[i]), int(out.accepted[i]), n)
      toks = [int(t) for t in np.asarray(out.tokens[i, :n])]
      if toks:
        self._deliver(h, toks)
      if out.done[i]:
        self._leave(h, "stop" if toks and toks[-1] in self.stop_ids else "length")
    if self.metrics is not None:
      self.metrics.round(emitted, seconds, out.width)

  def _deliver(self, h: Handle, tokens: list[int]) -> None:
    h.n_out += len(tokens)
    h.sink({"tokens": tokens})

  def _leave(self, h: Handle, reason: str) -> None:
    self.engine.finish([h.slot])
    self._slots[h.slot] = None
    self._end(h, reason)

  def _end(self, h: Handle, reason: str, error: str | None = None) -> None:
    h.finished = True
    self._live.pop(h.id, None)
    if self.metrics is not None:
      self.metrics.request_done(reason, h.n_out)
    h.sink({"finish_reason": reason, "usage": h.usage.as_dict(), "error": error})
