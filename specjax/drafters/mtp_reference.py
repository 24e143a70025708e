"""MTP heads in the DeepSeek-V3 / Qwen3-Next next-token layouts (stub, filled below)."""

from __future__ import annotations

import json
from pathlib import Path


def is_reference_folder(path) -> bool:
  """A folder with a config.json naming MTP layers (`num_nextn_predict_layers` or `mtp_num_hidden_layers`)."""
  cfg = Path(path) / "config.json"
  if not cfg.is_file():
    return False
  try:
    meta = json.loads(cfg.read_text())
  except ValueError:
    return False
  return bool(meta.get("num_nextn_predict_layers") or meta.get("mtp_num_hidden_layers"))
