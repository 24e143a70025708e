"""Choosing between a Pallas kernel and its XLA reference, shared by the kernels of this folder.

Each kernel has a `KernelSwitch`: "auto" (default), "pallas" or "xla", from `set_impl` or else
from its environment variable. Under auto a kernel serves only on a GPU (and only if its switch's
`auto_kernel` is on: a kernel measured slower than its reference is opt-in), and only for shapes
whose probe (compile the kernel, run it and the reference on random inputs, compare) passed;
the probe runs once per shape key, in a worker thread (JAX's trace state is per thread, so it
executes even while the caller is being traced), and a failure logs one warning and leaves that
shape on the reference.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Callable

import jax

IMPLS = ("auto", "pallas", "xla")

log = logging.getLogger(__name__)


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def sm_count() -> int:
  """Streaming multiprocessors of the first device (132 SMs, a Hopper GPU's count, assumed when the
  device does not report it)."""
  try:
    return int(getattr(jax.devices()[0], "core_count", 0)) or 132
  except Exception:   # noqa: BLE001 - no device info
    return 132


class KernelSwitch:
  """The implementation choice for one kernel (`name` in warnings, `env` its variable)."""

  def __init__(self, name: str, env: str, auto_kernel: bool = True):
    self.name, self.env = name, env
    self.auto_kernel = auto_kernel  # under auto, the kernel serves (on a GPU, probe passed); False: opt-in
    self.forced: str | None = None
    self.probed: dict = {}        # shape key -> the probe passed
    self.warned: set = set()

  def set_impl(self, impl: str | None) -> None:
    """Force "pallas" or "xla" (or "auto"; None: back to the environment). Takes effect at the
    next trace: jitted callers already compiled keep their choice (`jax.clear_caches()`)."""
    if impl not in (None, *IMPLS):
      raise ValueError(f"unknown {self.name} implementation {impl!r}")
    self.forced = impl

  def current_impl(self) -> str:
    impl = self.forced or os.environ.get(self.env, "auto")
    if impl not in IMPLS:
      raise ValueError(f"{self.env}={impl!r}: expected auto, pallas or xla")
    return impl

  def warn_once(self, key, msg: str, logger: logging.Logger = log) -> None:
    if key not in self.warned:
      self.warned.add(key)
      logger.warning(msg)

  def auto_serves(self, key, probe: Callable[[], tuple[bool, str]], logger: logging.Logger = log) -> bool:
    """Under auto: the kernel serves only on a GPU, only if `auto_kernel` is on, and only once its
    probe for `key` agreed with the reference (`kernel_works`)."""
    return self.auto_kernel and on_gpu() and self.kernel_works(key, probe, logger)

  def kernel_works(self, key, probe: Callable[[], tuple[bool, str]], logger: logging.Logger = log) -> bool:
    """Run `probe` () -> (kernel agrees with the reference, what was compared) once per `key`.
    False, with one warning, if it disagrees or raises (a lowering / compile failure)."""
    if key not in self.probed:
      with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
          ok, detail = pool.submit(probe).result()
        except Exception as e:  # noqa: BLE001 - any lowering / compile failure means: use the reference
          self.probed[key] = False
          self.warn_once(key, f"{self.name} kernel failed to compile for {key} ({type(e).__name__}: {e}); "
                              "using the XLA reference", logger)
          return False
      self.probed[key] = bool(ok)
      if not ok:
        self.warn_once(key, f"{self.name} kernel differs from the XLA reference ({detail}) at {key}; "
                            "using the reference", logger)
    return self.probed[key]
