"""Provenance of a result: everything besides the config that changed its numbers.

A result file (bench, tune, eval-dflash) records the git revision, the device, the environment
(`XLA_FLAGS`, every `SPECJAX_*` switch: the verification-attention switch alone moved batch-1
tokens/s 1.83x; python / jax / jaxlib / flax / numpy versions; CUDA's versions on a GPU) and the
sha256 of the model and head files it ran, so two results can be compared knowing what differed.
`resume_mismatch` says what differs between a partial run and this process (a resumed run must not
mix rows measured under different switches or files).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path

import jax

# SPECJAX_* variables that change no measured number (places, the compile cache: compilation is
# never timed): recorded, but a resumed run may differ in them
UNMEASURED_VARS = ("SPECJAX_HOME", "SPECJAX_DATA", "SPECJAX_COMPILE_CACHE", "SPECJAX_COMPILE_CACHE_DIR",
                   "SPECJAX_GIT_REV")


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


def _dist_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except importlib.metadata.PackageNotFoundError:
    return None


@functools.lru_cache(maxsize=1)
def versions() -> dict:
  """python, jax, jaxlib, flax, numpy (and the CUDA plugin packages where installed)."""
  import jaxlib
  import numpy
  out = {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
         "flax": _dist_version("flax"), "numpy": numpy.__version__}
  for dist in ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt"):
    v = _dist_version(dist)
    if v is not None:
      out[dist] = v
  return out


@functools.lru_cache(maxsize=1)
def cuda_info() -> dict | None:
  """CUDA as jax sees it (None off a GPU): the backend's platform version and, where jax's CUDA
  plugin exposes them, the runtime / driver / cuDNN versions."""
  dev = jax.devices()[0]
  if dev.platform != "gpu":
    return None
  info: dict = {}
  try:
    from jax.extend import backend
    info["platform_version"] = backend.get_backend().platform_version
  except Exception:  # noqa: BLE001 - provenance is best effort, never a failure of the run
    pass
  try:
    from jax._src.lib import cuda_versions
  except ImportError:
    cuda_versions = None
  for key in ("cuda_runtime_get_version", "cuda_runtime_build_version", "cuda_driver_get_version",
              "cudnn_get_version", "cudnn_build_version"):
    fn = getattr(cuda_versions, key, None)
    if fn is not None:
      try:
        info[key.replace("_get_version", "").replace("_version", "")] = int(fn())
      except Exception:  # noqa: BLE001
        pass
  return info


def environment() -> dict:
  """XLA_FLAGS, every SPECJAX_* variable, library versions, CUDA versions (None off a GPU)."""
  return {"xla_flags": os.environ.get("XLA_FLAGS"),
          "specjax_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SPECJAX_")},
          "versions": versions(), "cuda": cuda_info()}


# ------------------------------------------------------------------------------------------------
# checksums of the files a run used


_DIGESTS: dict[tuple, str] = {}


def _stamped_sha256(path: Path, st: os.stat_result) -> str | None:
  """The checksum the fetch stamp beside `path` records, when the stamp also records this size and
  mtime (a stamp without them, or of another size / mtime, is not trusted)."""
  try:
    stamp = json.loads(path.with_name(path.name + ".sha256").read_text())
  except (OSError, ValueError):
    return None
  if isinstance(stamp, dict) and (stamp.get("size"), stamp.get("mtime_ns")) == (st.st_size, st.st_mtime_ns):
    return stamp.get("sha256") if isinstance(stamp.get("sha256"), str) else None
  return None


def file_sha256(path: str | Path) -> str:
  """sha256 of a file: from its fetch stamp while that matches the file's size and mtime, else hashed
  (once per process and file version)."""
  path = Path(path)
  st = path.stat()
  key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
  if key not in _DIGESTS:
    digest = _stamped_sha256(path, st)
    if digest is None:
      h = hashlib.sha256()
      with open(path, "rb") as f:
        while block := f.read(1 << 22):
          h.update(block)
      digest = h.hexdigest()
    _DIGESTS[key] = digest
  return _DIGESTS[key]


def _record(path: Path) -> dict:
  return {"path": str(path), "bytes": path.stat().st_size, "sha256": file_sha256(path)}


def model_files(source: str | None) -> list[dict]:
  """The files of a loaded model (`LoadedModel.source`): its GGUF file, or an HF directory's weights,
  config and tokenizer files; [] for a model with no file (a random test model)."""
  if not source:
    return []
  path = Path(source)
  if path.is_file():
    return [_record(path)]
  if path.is_dir():
    return [_record(p) for p in sorted(path.iterdir()) if p.is_file() and p.suffix in (".safetensors", ".json",
                                                                                        ".model", ".txt")]
  return []


def head_files(head: str | Path | None) -> list[dict]:
  """The files of a trained head: `X.safetensors` with its `X.json` and the shards its metadata
  names, given as either file or as a directory of them; [] when it is absent."""
  if head is None:
    return []
  path = Path(head)
  if path.is_dir():
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json"))
  else:
    weights = path.with_suffix(".safetensors") if path.suffix == ".json" else path
    files = [p for p in (weights, weights.with_suffix(".json")) if p.is_file()]
    if weights.is_file():
      files += [weights.with_name(n) for n in _shards(weights) if weights.with_name(n).is_file()]
  return [_record(p) for p in files]


def _shards(weights: Path) -> list[str]:
  try:
    from safetensors import safe_open
    with safe_open(str(weights), framework="numpy") as f:
      return [n for n in (f.metadata() or {}).get("shards", "").split(",") if n]
  except Exception:  # noqa: BLE001 - a broken file is reported by the loader, not here
    return []


def comparable(env: dict, device: dict) -> dict:
  """What must be equal for rows of two processes to share one result: the environment less the
  variables that change no measured number, and the device kind and count."""
  return {"xla_flags": env.get("xla_flags"),
          "specjax_env": {k: v for k, v in (env.get("specjax_env") or {}).items() if k not in UNMEASURED_VARS},
          "versions": env.get("versions"), "cuda": env.get("cuda"),
          "device": {k: device.get(k) for k in ("platform", "device_kind", "n_devices")}}


def resume_mismatch(before: dict, now: dict, prefix: str = "") -> str | None:
  """The first key at which two `comparable` (or any nested) dicts differ, as `key: A then, B now`."""
  for key in sorted(set(before) | set(now)):
    a, b = before.get(key), now.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
      found = resume_mismatch(a, b, f"{prefix}{key}.")
      if found:
        return found
    elif a != b:
      return f"{prefix}{key}: {a!r} then, {b!r} now"
  return None
