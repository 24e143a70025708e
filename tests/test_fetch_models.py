"""The model registry of `specjax fetch` (specjax/io/fetch.py `MODELS`) is well formed: every entry
names pinned packages whose wheels hold its chunks in order, a sha256 to check the joined file
against, a size for the progress bar, and a cache path of its own. No network: the downloads
themselves are tested with local wheels in test_fetch.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specjax.io import fetch

README = Path(__file__).resolve().parents[1] / "README.md"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)$")


@pytest.mark.parametrize("name", sorted(fetch.MODELS))
def test_an_entry_is_pinned_checksummed_and_in_chunk_order(name):
  src = fetch.MODELS[name]
  assert src.name == name and src.filename.endswith(".gguf")
  assert re.fullmatch(r"[0-9a-f]{64}", src.sha256), "sha256 must be 64 lowercase hex digits"
  assert 0 < src.size_mb < 50_000
  assert src.packages and len(src.packages) == len(src.members)
  dists = []
  for package, member in zip(src.packages, src.members):
    pin = PIN.match(package)
    assert pin, f"{package!r} is not pinned as dist==version"
    dists.append(pin.group(1))
    # the chunk lies inside the package's own import folder (a wheel's top folder is the dist name
    # with '-' as '_'), so a glob cannot pick up another package's file
    assert member.split("/")[0] == pin.group(1).replace("-", "_"), (package, member)
  if len(dists) > 1:                   # chunk packages are numbered 1..n, joined in that order
    numbers = [int(re.search(r"(\d+)$", d).group(1)) for d in dists]
    assert numbers == list(range(1, len(dists) + 1)), dists


def test_entries_do_not_collide_and_the_default_is_one_of_them(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_HOME", str(tmp_path))
  srcs = list(fetch.MODELS.values())
  assert fetch.DEFAULT_MODEL in fetch.MODELS
  assert len({s.sha256 for s in srcs}) == len({s.filename for s in srcs}) == len(srcs)
  paths = {fetch.model_path(n) for n in fetch.MODELS}
  assert len(paths) == len(srcs) and all(p.is_relative_to(tmp_path / "models") for p in paths)
  with pytest.raises(fetch.FetchError, match="unknown model 'nope'; known: "):
    fetch.model_path("nope")


def test_the_readme_names_every_fetchable_model():
  text = README.read_text()
  missing = [n for n in fetch.MODELS if n not in text]
  assert not missing, f"README.md does not mention {missing}"
