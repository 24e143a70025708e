"""Provenance of a result: git revision, device, library versions."""

from __future__ import annotations

import os
import platform
import subprocess

import jax


def git_revision() -> str:
  if os.environ.get("SPECJAX_GIT_REV"):
    return os.environ["SPECJAX_GIT_REV"]
  try:
    rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return rev + ("-dirty" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def device_info() -> dict:
  dev = jax.devices()[0]
  return {"platform": dev.platform, "device_kind": getattr(dev, "device_kind", str(dev)),
          "n_devices": jax.device_count(), "jax": jax.__version__, "python": platform.python_version(),
          "host": platform.machine()}
