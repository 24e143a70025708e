"""Timing a jitted call for micro-benchmarks (the kernel benches in experiments/)."""

from __future__ import annotations

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
