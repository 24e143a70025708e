"""Several hosts: `jax.distributed.initialize` from environment variables.

Every host runs the same program (`specjax generate --mesh ...` with the same arguments); the
environment tells each one where the coordinator is, how many processes there are and which one
it is:

    SPECJAX_COORDINATOR_ADDRESS   host:port of process 0's coordinator service
    SPECJAX_NUM_PROCESSES         processes in all
    SPECJAX_PROCESS_ID            this process, 0 .. N-1
    SPECJAX_LOCAL_DEVICE_IDS      optional: the local devices this process drives ("0,1")

(JAX's own JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID are read when the
SPECJAX_ names are unset.) With none of them set nothing happens: one process, as before.
After initialization `jax.devices()` lists the devices of every process, and a mesh built from it
spans the hosts; CPU processes talk through gloo collectives.
"""

from __future__ import annotations

import os
from typing import Mapping

import jax

from specjax.errors import UserError

_NAMES = {"coordinator": ("SPECJAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS"),
          "num_processes": ("SPECJAX_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
          "process_id": ("SPECJAX_PROCESS_ID", "JAX_PROCESS_ID"),
          "local_device_ids": ("SPECJAX_LOCAL_DEVICE_IDS", "JAX_LOCAL_DEVICE_IDS")}

_initialized = False


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict | None:
  """The `jax.distributed.initialize` arguments the environment gives, or None when it names no
  coordinator. A coordinator without a process count or id (or a bad number) is a UserError."""
  env = os.environ if environ is None else environ
  get = lambda key: next((env[n] for n in _NAMES[key] if env.get(n)), None)
  coordinator = get("coordinator")
  if coordinator is None:
    return None
  out: dict = {"coordinator_address": coordinator}
  for key in ("num_processes", "process_id"):
    raw = get(key)
    if raw is None or not raw.strip().isdigit():
      raise UserError(f"{_NAMES['coordinator'][0]} is set, so {_NAMES[key][0]} must be a non-negative "
                      f"integer; got {raw!r}")
    out[key] = int(raw)
  if out["num_processes"] < 1 or out["process_id"] >= out["num_processes"]:
    raise UserError(f"process id {out['process_id']} must be in [0, {out['num_processes']})")
  ids = get("local_device_ids")
  if ids:
    out["local_device_ids"] = [int(i) for i in ids.split(",") if i.strip()]
  return out


def initialize_from_env(environ: Mapping[str, str] | None = None) -> bool:
  """Join the process group the environment describes (once per process; call it before anything
  touches a device). Returns whether this process is part of a multi-process run."""
  global _initialized
  if _initialized:
    return True
  settings = settings_from_env(environ)
  if settings is None:
    return False
  jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU processes: gloo over TCP
  jax.distributed.initialize(**settings)
  _initialized = True
  return True


def is_main_process() -> bool:
  """Process 0 (the one that prints and writes result files in a multi-host run)."""
  return jax.process_index() == 0
