"""Multi-turn chat conversations for training data: read from ShareGPT or any chat JSONL and put in
one shape, `[{"role": "system" | "user" | "assistant", "content": str}, ...]`.

A record holds its turns under `messages` (`[{role, content}]`, the OpenAI / HF shape) or
`conversations` (`[{from, value}]`, ShareGPT's shape; `from` is human / gpt / system, ...).
`messages_of` keeps what a chat template can render and a head can learn from: an optional leading
system message, then strictly alternating user / assistant turns, starting with a user turn and
ending with an answered one. A record that opens with the model is read from its first user turn
(ShareGPT has some); the turns from the first one out of order or empty are dropped (and the user
turn left unanswered before them); a record with no answered user turn gives None.

`ChatFile` reads a JSONL of such records by index (line offsets found once, each line parsed when
asked), so a shuffled subset of a large file costs only its own lines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}


def messages_of(record: Mapping[str, Any]) -> list[dict] | None:
  """The record's conversation as alternating messages (see the module docstring), or None."""
  turns = record.get("messages", record.get("conversations"))
  if not isinstance(turns, list):
    return None
  msgs = []
  for t in turns:
    if not isinstance(t, Mapping):
      return None
    role = ROLES.get(str(t.get("role", t.get("from", ""))).lower())
    content = t.get("content", t.get("value"))
    if role is None or not isinstance(content, str):
      break                                  # a tool call, an image part ...: the conversation ends here
    msgs.append({"role": role, "content": content})
  system = msgs[:1] if msgs and msgs[0]["role"] == "system" and msgs[0]["content"].strip() else []
  rest = msgs[1:] if msgs and msgs[0]["role"] == "system" else msgs
  while rest and rest[0]["role"] != "user":
    rest = rest[1:]
  out: list[dict] = []
  for m in rest:
    if m["role"] != ("user" if len(out) % 2 == 0 else "assistant") or not m["content"].strip():
      break
    out.append(m)
  out = out[:len(out) // 2 * 2]              # end with an answered turn
  return system + out if out else None


class ChatFile:
  """Records of a JSONL file by index: `len(f)`, `f.messages(k)` (None where `messages_of` is)."""

  def __init__(self, path: str | Path):
    self.path = Path(path)
    if not self.path.is_file():
      raise FileNotFoundError(f"chat file {self.path} does not exist")
    data = np.fromfile(self.path, np.uint8)
    ends = np.flatnonzero(data == ord("\n")) + 1                       # [lines] byte offset after each newline
    starts = np.concatenate([[0], ends])
    stops = np.concatenate([ends, [len(data)]])
    keep = stops - starts > 1                                          # not an empty line (or the file's end)
    self._starts, self._stops = starts[keep], stops[keep]

  def __len__(self) -> int:
    return len(self._starts)

  def record(self, k: int) -> dict:
    with open(self.path, "rb") as f:
      f.seek(int(self._starts[k]))
      line = f.read(int(self._stops[k] - self._starts[k]))
    if not line.strip():
      return {}
    try:
      return json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{self.path}: line {k + 1} is not JSON ({e.msg})") from None

  def messages(self, k: int) -> list[dict] | None:
    return messages_of(self.record(k))
