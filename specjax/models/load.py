"""One entry point for loading a target or draft model: a fetch name, a GGUF file, or an HF dir."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from specjax.models.config import ModelConfig, from_hf_config
from specjax.models.weights import params_from_hf


@dataclasses.dataclass
class LoadedModel:
  """A model ready to run: static config, parameter pytree, and (when known) its tokenizer.

  `cfg` is what `params` hold and what the model's forward and KV cache run with. On a mesh whose
  model axis does not divide the KV heads, `api.shard` pads the target with zero KV groups
  (`parallel.pad_heads`: same output, a KV cache larger by padded / real KV heads): `cfg` is then
  the padded config and `unpadded_cfg` the checkpoint's own, which drafters are built for and head
  files are checked against (`logical_cfg`)."""
  name: str
  cfg: ModelConfig          # or a HybridConfig (specjax.models.hybrid_config) for hybrid targets
  params: Any
  tokenizer: Any = None
  source: str = ""
  context_length: int | None = None   # trained positions (max_position_embeddings); None = unknown
  mesh: Any = None          # the jax.sharding.Mesh its params are sharded over (specjax.parallel); None = one device
  unpadded_cfg: Any = None  # the checkpoint's config when `cfg` has zero KV groups added for `mesh`; None = cfg
  head_placement: str = "replicated"   # on `mesh`, trained drafter heads "replicated" or "sharded" (`parallel.place_drafter`)

  @property
  def logical_cfg(self):
    """The checkpoint's own config (its real heads and KV heads): what drafters (MTP, EAGLE-3,
    DFlash heads) are built for and their head files checked against. `cfg` itself unless padded."""
    return self.unpadded_cfg if self.unpadded_cfg is not None else self.cfg


def require_unpadded(target: LoadedModel, what: str) -> None:
  """A UserError when `target` runs with zero-padded KV groups (`api.shard` on a model axis that does
  not divide its KV heads): head training runs the target and builds the head from one config."""
  if getattr(target, "unpadded_cfg", None) is not None:
    from specjax.errors import UserError
    raise UserError(f"{what} needs the target as loaded (its KV heads padded for a mesh here): load it "
                    "without a mesh (`specjax.train.loop.train(..., mesh=)` shards the training step)")


def resolve_path(name_or_path: str) -> Path:
  """A fetch name (downloaded on first use; fetched again when the cached file no longer matches its
  sha256) or an existing GGUF file / HF directory."""
  from specjax.io import fetch
  if name_or_path in fetch.MODELS:
    return fetch.fetch(name_or_path)
  path = Path(name_or_path).expanduser()
  if not path.exists():
    raise FileNotFoundError(f"{name_or_path!r} is neither a known model ({', '.join(sorted(fetch.MODELS))}) "
                            "nor an existing GGUF file / HF checkpoint directory")
  fetch.check_cached(path)     # a file fetched into the cache and changed since: corrupt, refused
  return path


def load_model(name_or_path: str, dtype=jnp.float32, *, with_tokenizer: bool = True,
               progress: bool = True) -> LoadedModel:
  """The model at `name_or_path` with its parameters in `dtype` on the default device. Tensors are
  read, converted and moved to the device one at a time (host memory: about the largest tensor)."""
  path = resolve_path(name_or_path)
  tokenizer = None
  if path.is_dir():
    from specjax.io.safetensors import load_safetensors_dir
    hf, tensors = load_safetensors_dir(path)
    if with_tokenizer and (path / "tokenizer.json").is_file():
      from specjax.io.hf_tokenizer import HFTokenizer
      tokenizer = HFTokenizer(path)
  elif path.suffix == ".gguf":
    from gguf import GGUFReader
    from specjax.io.gguf import load_gguf
    reader = GGUFReader(str(path))
    hf, tensors = load_gguf(path, reader=reader)
    if with_tokenizer:
      from specjax.io.tokenizer import Tokenizer
      tokenizer = Tokenizer.from_gguf(reader)
  else:
    raise ValueError(f"{path}: expected a .gguf file or an HF checkpoint directory")
  tensors = _ReadProgress(tensors, f"load {path.name}", progress)
  from specjax.models import hybrid_config, hybrid_weights
  if hybrid_config.is_hybrid_hf_config(hf):     # attention + gated DeltaNet (Qwen3.5)
    cfg = hybrid_config.hybrid_config_from_hf(hf)
    params = hybrid_weights.params_from_hf(cfg, tensors, dtype=dtype)
  else:
    cfg = from_hf_config(hf)
    params = params_from_hf(cfg, tensors, dtype=dtype)
  return LoadedModel(name=Path(name_or_path).stem if not path.is_dir() else path.name,
                     cfg=cfg, params=params, tokenizer=tokenizer, source=str(path),
                     context_length=_positive_int(hf.get("max_position_embeddings")))


class _ReadProgress(Mapping):
  """A checkpoint's lazy tensor mapping with a progress bar that advances as tensors are read
  (the loaders read each tensor once, while filling the parameters)."""

  def __init__(self, tensors: Mapping, desc: str, enabled: bool):
    from tqdm.auto import tqdm
    self._tensors = tensors
    self._bar = tqdm(total=len(tensors), desc=desc, unit="tensor", disable=not enabled, leave=False)

  def __getitem__(self, name):
    arr = self._tensors[name]
    self._bar.update(1)
    if self._bar.n >= (self._bar.total or 0):
      self._bar.close()
    return arr

  def __iter__(self):
    return iter(self._tensors)

  def __len__(self):
    return len(self._tensors)

  def __contains__(self, name):
    return name in self._tensors


def _positive_int(x) -> int | None:
  try:
    return int(x) if x is not None and int(x) > 0 else None
  except (TypeError, ValueError):
    return None
