"""The files of specjax's cache (`$SPECJAX_HOME`, default ~/.cache/specjax) and what keeps them
whole: a `.sha256` stamp beside each cached file records its checksum, size and mtime (while size
and mtime are unchanged the stamp is trusted, otherwise the file is hashed again), and everything a
fetch writes lives in a hidden `.fetch-*` folder removed on every exit path (SIGTERM raises inside
one so that happens on a kill too; folders left by SIGKILL or a power loss are swept once they are
an hour old). Used by `specjax.io.fetch` (models) and `specjax.io.datasets` (prompt sets, data).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Sequence

STALE_TEMP_S = 3600.0                                  # a `.fetch-*` folder untouched this long is swept


def specjax_home() -> Path:
  return Path(os.environ.get("SPECJAX_HOME", Path.home() / ".cache" / "specjax"))


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(chunk):
      h.update(block)
  return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# stamps: checksum + size + mtime of a cached file


def stamp_path(path: Path) -> Path:
  return path.with_name(path.name + ".sha256")


def write_stamp(path: Path, sha256: str) -> None:
  """Record that `path`, as it is now (size, mtime), has checksum `sha256`."""
  st = path.stat()
  stamp = stamp_path(path)
  tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}")
  tmp.write_text(json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}) + "\n")
  os.replace(tmp, stamp)


def read_stamp(path: Path) -> dict | None:
  """The stamp of `path`: {"sha256", "size", "mtime_ns"}; an older stamp holds the checksum only."""
  try:
    text = stamp_path(path).read_text().strip()
  except OSError:
    return None
  try:
    stamp = json.loads(text)
  except ValueError:
    stamp = None
  if isinstance(stamp, dict) and isinstance(stamp.get("sha256"), str):
    return stamp
  return {"sha256": text} if re.fullmatch(r"[0-9a-f]{64}", text) else None


def is_verified(path: Path, sha256: str | None = None) -> bool:
  """True when `path` holds the file of checksum `sha256` (default: the one its stamp records).

  The stamp is trusted while the file's size and mtime are the ones it recorded; otherwise the file
  is hashed again (and re-stamped when it matches, where the folder is writable)."""
  try:
    st = path.stat()
  except OSError:
    return False
  stamp = read_stamp(path)
  want = sha256 or (stamp or {}).get("sha256")
  if want is None:
    return False
  if stamp and stamp["sha256"] == want and (stamp.get("size"), stamp.get("mtime_ns")) == (st.st_size, st.st_mtime_ns):
    return True
  if sha256_of(path) != want:
    return False
  with contextlib.suppress(OSError):     # a read-only cache stays usable
    write_stamp(path, want)
  return True


# ----------------------------------------------------------------------------------------------
# temporary folders that never outlive their fetch


def _main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _terminate_raises() -> Iterator[None]:
  """Inside: SIGTERM raises SystemExit(143), so `finally` blocks (temp cleanup) run on a kill; a
  second SIGTERM during that cleanup is ignored. The previous handler is restored after."""
  if not _main_thread():
    yield
    return

  def handler(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)

  previous = signal.signal(signal.SIGTERM, handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
  """Inside: Ctrl-C and SIGTERM wait (a cleanup is not cut short by a second interrupt)."""
  if not _main_thread():
    yield
    return
  previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


def sweep_stale_temp(folders: Sequence[Path] = (), max_age_s: float = STALE_TEMP_S) -> None:
  """Remove `.fetch-*` folders untouched for `max_age_s` in `folders` and in the cache's folders
  (left by a fetch killed with SIGKILL, which no handler sees)."""
  home = specjax_home()
  candidates = [*folders, home / "data", *(home / "models").glob("*")]
  now = time.time()
  for folder in dict.fromkeys(Path(f) for f in candidates):
    for tmp in folder.glob(".fetch-*"):
      try:
        newest = max([tmp.stat().st_mtime] + [p.stat().st_mtime for p in tmp.rglob("*")])
      except OSError:
        continue
      if now - newest > max_age_s:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def temp_folder(parent: Path) -> Iterator[Path]:
  """A hidden `.fetch-*` folder in `parent` (same file system: its files move into place with one
  rename), removed on every exit path: return, exception, Ctrl-C, SIGTERM."""
  parent.mkdir(parents=True, exist_ok=True)
  sweep_stale_temp([parent])
  with _terminate_raises():
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=".fetch-"))
    try:
      yield tmp
    finally:
      with _signals_ignored():
        shutil.rmtree(tmp, ignore_errors=True)
