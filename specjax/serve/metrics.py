"""Server metrics in the Prometheus text format (`prometheus_client`, one registry per server).

Updated by the model thread (rounds, first tokens, finished requests) and read by `/metrics`:
tokens/s over a sliding window, tau (tokens emitted per slot-round), acceptance by draft
position, rounds by verification width (adaptive drafting's choices) and by batch bucket, device
calls, XLA compilations in the server's process (one after warm-up stalls every slot while it
runs), queue length and running slots.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref

import jax

import numpy as np

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

WINDOW_S = 10.0   # tokens/s is measured over the last WINDOW_S seconds of rounds
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"   # jax.monitoring's event per XLA compile

_live: weakref.WeakSet = weakref.WeakSet()    # the servers whose metrics count compilations
_listening = False


def _on_event(name: str, seconds: float, **_) -> None:
  if name == COMPILE_EVENT:
    for m in list(_live):
      m.compiled(seconds)


def _count_compiles(metrics) -> None:
  """Count this process's XLA compilations into `metrics` (jax.monitoring keeps listeners for the
  process's life, so one listener serves every server)."""
  global _listening
  _live.add(metrics)
  if not _listening:
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    _listening = True


class ServeMetrics:
  """The counters, gauges and histograms of one server."""

  def __init__(self, max_draft: int):
    self.registry = r = CollectorRegistry()
    self.content_type = CONTENT_TYPE_LATEST
    self.tokens = Counter("specjax_generated_tokens", "tokens emitted to requests", registry=r)
    self.rounds = Counter("specjax_rounds", "rounds run over the slot batch", registry=r)
    self.widths = Counter("specjax_rounds_at_width", "rounds by verification width (0: plain decoding step)",
                          ["width"], registry=r)
    self.batches = Counter("specjax_rounds_at_batch", "rounds by batch bucket (the live slots gathered)",
                           ["batch"], registry=r)
    self.calls = Counter("specjax_device_calls", "device calls of rounds (one host round trip each)", registry=r)
    self.prefill_calls = Counter("specjax_prefill_calls", "prefill calls (joining requests' prompt pieces, stacked)",
                                 registry=r)
    self.prefill_rows = Counter("specjax_prefill_rows", "prompt pieces prefilled (a call's rows before padding)",
                                registry=r)
    self.compiles = Counter("specjax_compiles", "XLA compilations in the server's process", registry=r)
    self.compile_seconds = Counter("specjax_compile_seconds", "seconds spent in XLA compilations", registry=r)
    self.thread_seconds = Counter("specjax_model_thread_seconds",
                                  "the model thread's wall time by part: rounds (calls of rounds, waited for), "
                                  "prefill (prefill calls dispatched, admissions), host (the rest)", ["part"], registry=r)
    self.step_seconds = Counter("specjax_step_seconds",
                                "the calls of rounds by part: call (the jitted call until it returns), fetch (its "
                                "outputs to the host), observe (adaptive controller updates), step (all of it)",
                                ["part"], registry=r)
    self.adaptive_ms = Gauge("specjax_adaptive_round_ms",
                             "the adaptive controller's running cost of a round (ms) by batch bucket and width",
                             ["bucket", "width"], registry=r)
    self.adaptive_tau = Gauge("specjax_adaptive_tau", "the adaptive controller's expected tokens per slot-round by "
                              "width (replayed or tallied; absent for position-rate controllers)", ["width"], registry=r)
    self.adaptive_cuts = Gauge("specjax_adaptive_calls_cut", "calls the adaptive controller planned shorter than the "
                               "scheduler asked, by the rule that cut them (fresh slots, an exploring stretch's "
                               "edge, a one-round probe), since the server started", ["rule"], registry=r)
    self.slot_rounds = Counter("specjax_slot_rounds", "rounds summed over live slots", registry=r)
    self.drafted = Counter("specjax_draft_tokens", "draft tokens verified", registry=r)
    self.accepted = Counter("specjax_accepted_tokens", "draft tokens accepted", registry=r)
    self.requests = Counter("specjax_requests", "finished requests by reason", ["reason"], registry=r)
    self.rejected = Counter("specjax_rejected_requests", "requests refused (400 malformed, 429 queue full)",
                            ["code"], registry=r)
    self.tps = Gauge("specjax_tokens_per_second", f"tokens emitted per second over the last {WINDOW_S:g} s",
                     registry=r)
    self.tau = Gauge("specjax_tau", "tokens emitted per slot-round since start (1 = no speculation gain)",
                     registry=r)
    self.by_pos = Gauge("specjax_acceptance_by_position", "accepted / drafted at each draft position",
                        ["position"], registry=r)
    self.queue = Gauge("specjax_queue_length", "requests waiting for a slot", registry=r)
    self.running = Gauge("specjax_running_slots", "slots generating", registry=r)
    self.ttft = Histogram("specjax_time_to_first_token_seconds", "submission to first token", registry=r,
                          buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
    self._pos = np.zeros((max_draft, 2), np.int64)      # [drafted, accepted] per position
    self._window: collections.deque[tuple[float, int]] = collections.deque()   # (time, tokens) of recent calls
    self._in_window = 0                                                         # their tokens
    self._emitted = self._slot_rounds = 0
    self._lock = threading.Lock()
    _count_compiles(self)

  def compiled(self, seconds: float) -> None:
    """One XLA compilation of `seconds` in this process (any thread)."""
    self.compiles.inc()
    self.compile_seconds.inc(seconds)

  def rounds_run(self, emitted, drafted, accepted, seconds: float, width: int = 0, batch: int = 0) -> None:
    """A call of rounds at verification width `width` over a bucket of `batch` slots, `seconds`
    long: emitted, drafted, accepted [R, B] per round and slot (a slot emits in every round it is live)."""
    now = time.perf_counter()
    live = emitted > 0
    n_rounds, n_emitted, n_live = emitted.shape[0], int(emitted.sum()), int(live.sum())
    pos = np.arange(len(self._pos))
    by_pos = np.stack([((drafted[:, :, None] > pos) & live[:, :, None]).sum(axis=(0, 1)),
                       ((accepted[:, :, None] > pos) & live[:, :, None]).sum(axis=(0, 1))], axis=1)
    with self._lock:
      self.rounds.inc(n_rounds)
      self.calls.inc()
      self.widths.labels(width=str(width)).inc(n_rounds)
      self.batches.labels(batch=str(batch)).inc(n_rounds)
      self._window.append((now, n_emitted))
      self._in_window += n_emitted
      while self._window and self._window[0][0] < now - WINDOW_S:
        self._in_window -= self._window.popleft()[1]
      span = max(now - self._window[0][0], seconds, 1e-6)
      self.tps.set(self._in_window / span)
      self.tokens.inc(n_emitted)
      self.slot_rounds.inc(n_live)
      self.drafted.inc(int(drafted.sum()))
      self.accepted.inc(int(accepted.sum()))
      self._emitted += n_emitted
      self._slot_rounds += n_live
      if self._slot_rounds:
        self.tau.set(self._emitted / self._slot_rounds)
      self._pos += by_pos
      for i in np.flatnonzero(by_pos[:, 0]):
        self.by_pos.labels(position=str(i)).set(self._pos[i, 1] / self._pos[i, 0])

  def prefilled(self, rows: int) -> None:
    """One prefill call of `rows` joining requests' pieces."""
    self.prefill_calls.inc()
    self.prefill_rows.inc(rows)

  def adaptive(self, record: dict) -> None:
    """The adaptive controller's state (`record()` of `adaptive_slots` / `adaptive_tree_slots`):
    its cost of a round at each width, over every slot ("all") and per smaller bucket, and its
    expected tokens per round at each width where it has them."""
    widths = record["widths"]
    by_bucket = {"all": record["costs_ms"], **record.get("costs_ms_by_bucket", {})}
    for bucket, costs in by_bucket.items():
      for w, ms in zip(widths, costs):
        self.adaptive_ms.labels(bucket=str(bucket), width=str(w)).set(ms)
    tau = record.get("replayed_tau", record.get("tau_by_budget"))
    for w, t in zip(widths, tau or ()):
      self.adaptive_tau.labels(width=str(w)).set(t)
    for rule, n in record.get("calls_cut", {}).items():
      self.adaptive_cuts.labels(rule=rule).set(n)

  def thread_time(self, rounds: float, prefill: float, host: float) -> None:
    """One scheduler iteration's wall time by part."""
    for part, s in (("rounds", rounds), ("prefill", prefill), ("host", host)):
      self.thread_seconds.labels(part=part).inc(s)

  def step_time(self, parts: dict[str, float]) -> None:
    """Seconds of calls of rounds by part (`SlotEngine.take_step_seconds`)."""
    for part, s in parts.items():
      self.step_seconds.labels(part=part).inc(s)

  def first_token(self, seconds: float) -> None:
    self.ttft.observe(seconds)

  def request_done(self, reason: str, n_out: int) -> None:
    self.requests.labels(reason=reason).inc()

  def refused(self, code: int) -> None:
    self.rejected.labels(code=str(code)).inc()

  def set_load(self, queue: int, running: int) -> None:
    self.queue.set(queue)
    self.running.set(running)

  def render(self) -> bytes:
    return generate_latest(self.registry)
