"""Load HF checkpoints: a directory with `config.json` and `*.safetensors` shards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def load_safetensors_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(config.json dict, {HF tensor name: float32 array}) of an HF checkpoint directory."""
  from safetensors import safe_open
  path = Path(path)
  cfg_file = path / "config.json"
  if not cfg_file.exists():
    raise FileNotFoundError(f"{path} has no config.json: not an HF checkpoint directory")
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"{path} has no *.safetensors files")
  hf = json.loads(cfg_file.read_text())
  tensors: dict[str, np.ndarray] = {}
  for f in files:
    with safe_open(str(f), framework="numpy") as sf:
      for name in sf.keys():
        arr = sf.get_tensor(name)
        key = name.replace("model.language_model.", "model.")   # gemma3 multimodal layout
        tensors[key] = arr.astype(np.float32) if arr.dtype != np.float32 else arr
  if "lm_head.weight" not in tensors:
    hf.setdefault("tie_word_embeddings", True)
  return hf, tensors
