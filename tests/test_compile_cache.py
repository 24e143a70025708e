"""The CLI's persistent compilation cache: a compiled program is written under the configured
folder and found again by a fresh process (a cache hit, no new entry); SPECJAX_COMPILE_CACHE=0
turns it off. Each case runs in its own Python process (JAX initialises its cache once)."""

from __future__ import annotations

import os
import subprocess
import sys

PROGRAM = """
import jax, jax.numpy as jnp
from jax._src import monitoring   # JAX's own cache counters (internal API, same on jax 0.10 and 0.11)
monitoring.register_event_listener(lambda e, **k: print('EVENT', e) if e.endswith(('cache_hits', 'cache_misses')) else None)
from specjax.io import compile_cache
print(compile_cache.enable(min_compile_seconds=0.0))
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3.0 + 1.0)
print(float(f(jnp.arange(64.0).reshape(8, 8) / 64)))
"""


def _run(env_extra: dict) -> str:
  env = {k: v for k, v in os.environ.items() if k != "SPECJAX_COMPILE_CACHE"}   # conftest turns it off
  env.update(env_extra, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  return out.stdout


def test_compiled_programs_persist_across_processes(tmp_path):
  cache = tmp_path / "cache"
  first = _run({"SPECJAX_COMPILE_CACHE_DIR": str(cache)})
  lines = [l for l in first.splitlines() if not l.startswith("EVENT")]
  assert lines[0] == str(cache)
  entries = sorted(p.name for p in cache.iterdir())
  assert entries, "no compiled program was written"
  assert "cache_misses" in first and "cache_hits" not in first
  second = _run({"SPECJAX_COMPILE_CACHE_DIR": str(cache)})
  assert [l for l in second.splitlines() if not l.startswith("EVENT")][1] == lines[1]   # same result
  assert "cache_hits" in second and "cache_misses" not in second                       # read back, not compiled
  assert sorted(p.name for p in cache.iterdir()) == entries


def test_switched_off(tmp_path):
  cache = tmp_path / "cache"
  out = _run({"SPECJAX_COMPILE_CACHE_DIR": str(cache), "SPECJAX_COMPILE_CACHE": "0"})
  assert out.splitlines()[0] == "None" and not cache.exists() and "cache_hits" not in out
