"""JAX's persistent compilation cache for the command line.

A speculative loop is one large jitted program per (model, speculator, shapes): each bench method
compiles for tens of seconds, on a GPU as on a CPU, and without a cache every new process pays that
again. The CLI (`specjax generate | bench | tune | train`) therefore keeps XLA's compiled
executables on disk, under `$SPECJAX_HOME/jax_cache` (or `SPECJAX_COMPILE_CACHE_DIR`), so a rerun
of the same command with the same shapes loads them instead. `SPECJAX_COMPILE_CACHE=0` turns it
off. Library users keep JAX's own setting: importing specjax changes nothing.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import jax


def cache_dir() -> Path | None:
  """Where the CLI keeps compiled programs, or None when turned off."""
  if os.environ.get("SPECJAX_COMPILE_CACHE", "1").strip().lower() in ("0", "false", "off", "no"):
    return None
  if os.environ.get("SPECJAX_COMPILE_CACHE_DIR"):
    return Path(os.environ["SPECJAX_COMPILE_CACHE_DIR"])
  from specjax.io.file_cache import specjax_home
  return specjax_home() / "jax_cache"


def enable(min_compile_seconds: float = 1.0) -> Path | None:
  """Turn on the persistent cache for programs that took at least `min_compile_seconds` to
  compile (small ones are cheaper to rebuild than to read). Returns the folder, or None."""
  path = cache_dir()
  if path is None:
    return None
  if jax.config.jax_compilation_cache_dir:       # the user configured one: leave it
    return Path(jax.config.jax_compilation_cache_dir)
  if not _writable(path):                         # e.g. a read-only SPECJAX_HOME: run, just uncached
    print(f"note: compile cache off ({path} is not writable); set SPECJAX_COMPILE_CACHE_DIR to a "
          "writable folder to keep compiled programs", file=sys.stderr)
    return None
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


def _writable(path: Path) -> bool:
  """The folder exists (or can be made) and a file can be created in it."""
  try:
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
      return True
  except OSError:
    return False
