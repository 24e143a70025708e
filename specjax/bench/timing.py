"""Timing: a jitted call for micro-benchmarks (the kernel benches in experiments/), and a timed call
with the process's heap out of the collector (the bench harness, experiments/)."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import jax


def time_call(fn, args, repeats: int, iters: int) -> float:
  """Median milliseconds per iteration of `fn(*args)`, a call that runs `iters` dependent
  iterations on the device; the first call (compilation, warm-up) is not timed."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) / iters * 1e3


@contextlib.contextmanager
def heap_frozen():
  """A timed call with what the process already holds (the model, compiled programs, earlier rows:
  ~0.4M objects after loading SmolLM2, a full collection ~0.12 s) frozen out of the cyclic
  collector's generations, so a collection inside the call scans only what the call allocates
  (a host drafter's tries and lists still cost their collections) instead of landing a
  heap-sized pause in whichever method's call it happens to hit. Undone after the call."""
  gc.freeze()
  try:
    yield
  finally:
    gc.unfreeze()
