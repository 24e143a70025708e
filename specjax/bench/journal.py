"""Nothing lost: the rows of a run are on disk as soon as they complete.

A bench run keeps two files side by side. `<stem>.json` is the result (summary and rows, no tokens),
rewritten atomically (a temporary file, then `os.replace`) as rows complete, so a reader or a kill
never sees half a file. `<stem>.rows.jsonl` is the journal: a header line (the config and
the provenance of the run), then one line per completed row with its generated tokens, appended in
one write and fsynced per call. A run killed at any point keeps every row of its journal (a torn
last line is dropped); `--resume` reads them back, checks that the config and the environment are
the ones the rows were measured under, and runs only the rest. The journal is removed when the run
completes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

JOURNAL_FORMAT = "specjax-bench-rows-v1"


def json_ready(x):
  """Tuples -> lists, via one JSON round trip (what a value compares as once it was on disk)."""
  return json.loads(json.dumps(x))


def write_json_atomic(path: str | Path, data, indent: int | None = 1, default=None) -> Path:
  """Write `data` as JSON to `path` so that the file is always either the old or the new whole file."""
  path = Path(path)
  tmp = path.with_name(f".{path.name}.tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(json.dumps(data, indent=indent, default=default) + "\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  return path


def journal_path(result_path: str | Path) -> Path:
  p = Path(result_path)
  return p.with_name(p.stem + ".rows.jsonl")


class RowJournal:
  """The completed rows of one run, one JSON line each, after a header line."""

  def __init__(self, path: str | Path):
    self.path = Path(path)

  def exists(self) -> bool:
    return self.path.is_file()

  def start(self, header: dict, rows: list[dict] = ()) -> None:
    """A fresh journal holding `header` and `rows`, replacing an earlier one at this path at once
    (a resumed run rewrites its journal so that no torn line is left before the rows it appends)."""
    text = "".join(json.dumps(r) + "\n" for r in [{"format": JOURNAL_FORMAT, **header}, *rows])
    tmp = self.path.with_name(f".{self.path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.path)

  def read(self) -> tuple[dict, list[dict]]:
    """(header, rows); a last line cut short by a kill is dropped."""
    lines = self.path.read_text(encoding="utf-8").splitlines()
    if not lines:
      raise ValueError(f"{self.path}: empty journal")
    header = json.loads(lines[0])
    if not isinstance(header, dict) or header.get("format") != JOURNAL_FORMAT:
      raise ValueError(f"{self.path}: not a bench rows journal")
    rows = []
    for i, line in enumerate(lines[1:], start=2):
      try:
        rows.append(json.loads(line))
      except ValueError:
        if i != len(lines):
          raise ValueError(f"{self.path}: line {i} is not JSON") from None
    return header, rows

  def append(self, rows: list[dict]) -> None:
    """Rows completed together (one generation call): one write, flushed to the disk."""
    if not rows:
      return
    text = "".join(json.dumps(r) + "\n" for r in rows)
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())

  def remove(self) -> None:
    self.path.unlink(missing_ok=True)
