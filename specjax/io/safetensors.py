"""Load HF checkpoints: a directory with `config.json` and `*.safetensors` shards.

Tensors are read lazily, one at a time, in the dtype the file stores them in (`SafetensorsTensors`):
a loader that turns each into a device array before asking for the next holds about one tensor on
the host, whatever the size of the checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import numpy as np


class SafetensorsTensors(Mapping):
  """{HF tensor name: numpy array} over the `*.safetensors` files of a folder, read on access.

  Each access opens the tensor's file, copies the tensor out and closes the file, so the file's
  memory map (and the pages it touched) is released before the next tensor is read. Names of
  multimodal Gemma-3 checkpoints (`model.language_model.*`) are given as the text model's.
  """

  def __init__(self, files: list[Path]):
    from safetensors import safe_open
    self._where: dict[str, tuple[Path, str]] = {}        # our name -> (file, name in the file)
    for f in files:
      with safe_open(str(f), framework="numpy") as sf:
        for name in sf.keys():
          self._where[name.replace("model.language_model.", "model.")] = (f, name)

  def __getitem__(self, name: str) -> np.ndarray:
    from safetensors import safe_open
    f, stored = self._where[name]
    with safe_open(str(f), framework="numpy") as sf:
      return sf.get_tensor(stored)

  def __iter__(self) -> Iterator[str]:
    return iter(self._where)

  def __len__(self) -> int:
    return len(self._where)

  def __contains__(self, name: object) -> bool:
    return name in self._where


def load_safetensors_dir(path: str | Path) -> tuple[dict[str, Any], SafetensorsTensors]:
  """(config.json dict, lazy {HF tensor name: array}) of an HF checkpoint directory."""
  path = Path(path)
  cfg_file = path / "config.json"
  if not cfg_file.exists():
    raise FileNotFoundError(f"{path} has no config.json: not an HF checkpoint directory")
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"{path} has no *.safetensors files")
  hf = json.loads(cfg_file.read_text())
  tensors = SafetensorsTensors(files)
  if "lm_head.weight" not in tensors:
    hf.setdefault("tie_word_embeddings", True)
  return hf, tensors
