"""Self-distillation datasets read back (`specjax.train.data` writes them): token rows in memory,
the target's taps memory-mapped, batches that are a pure function of (step, seed).

A row's `loss_mask` [W] marks the tokens a head learns to predict: the response of a prompt row
(`prompt_lens <= p < lens`; derived for shards written before masks were stored), the assistant
turns of a chat row (`specjax.train.chat_data`: the user turns between them are not learned).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import ml_dtypes
import numpy as np


def decode_taps(arr: np.ndarray, taps_dtype: str) -> np.ndarray:
  return arr.view(ml_dtypes.bfloat16) if taps_dtype == "bfloat16" else arr



class ShardDataset:
  """Built datasets, read back (one folder or several, concatenated): token rows in memory, taps
  memory-mapped."""

  def __init__(self, path: str | Path | Sequence[str | Path], max_rows: int | None = None):
    paths = [Path(p) for p in ([path] if isinstance(path, (str, Path)) else path)]
    self.path = paths[0]
    parts, self._taps, self._where, has_taps, self.infos = [], [], [], [], []
    for folder in paths:
      manifest_path = folder / "manifest.json"
      if not manifest_path.exists():
        raise FileNotFoundError(f"{folder} holds no dataset (no manifest.json); build it with "
                                f"`specjax train data --config ...`")
      info = json.loads((folder / "info.json").read_text())
      self.infos.append(info)
      data = info["identity"]["data"]
      has_taps.append(bool(data["store_taps"]))
      for sh in json.loads(manifest_path.read_text())["shards"]:
        stem = folder / f"shard_{sh['index']:05d}"
        with np.load(f"{stem}.npz") as z:
          part = {k: z[k] for k in ("tokens", "lens", "prompt_lens", "source")}
          part["loss_mask"] = z["loss_mask"].astype(bool) if "loss_mask" in z.files else response_mask(
              part["lens"], part["prompt_lens"], part["tokens"].shape[1])
          parts.append(part)
        if data["store_taps"]:
          self._taps.append((np.load(f"{stem}.prenorm.npy", mmap_mode="r"), data["taps_dtype"]))
        else:
          self._taps.append(None)
        self._where.extend((len(parts) - 1, r) for r in range(sh["rows"]))
    if not parts:
      raise ValueError(f"{', '.join(map(str, paths))}: no shards yet")
    widths = {p["tokens"].shape[1] for p in parts}
    if len(widths) > 1:
      raise ValueError(f"datasets of different row widths {sorted(widths)} cannot be mixed: build them with "
                       f"the same max_prompt_len + max_new_tokens")
    self.info = self.infos[0]
    self.has_taps = all(has_taps)
    self.arrays = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    if max_rows is not None:
      self.arrays = {k: v[:max_rows] for k, v in self.arrays.items()}
      self._where = self._where[:max_rows]

  def __len__(self) -> int:
    return len(self._where)

  @property
  def width(self) -> int:
    return self.arrays["tokens"].shape[1]

  @property
  def n_response_tokens(self) -> int:
    """Tokens learned: the responses of prompt rows, the assistant turns of chat rows."""
    return int(self.arrays["loss_mask"].sum())

  def rows(self, idx: np.ndarray, with_taps: bool = True) -> dict[str, np.ndarray]:
    out = {k: self.arrays[k][idx] for k in ("tokens", "lens", "prompt_lens", "loss_mask")}
    if with_taps and self.has_taps:
      out["prenorm"] = np.stack([decode_taps(np.asarray(self._taps[s][0][r]), self._taps[s][1]).astype(np.float32)
                                 for s, r in (self._where[i] for i in idx)])
    return out

  def batch(self, step: int, batch_size: int, seed: int = 0, with_taps: bool = True,
            max_len: int | None = None) -> dict[str, np.ndarray]:
    """Batch number `step`: rows of epoch-wise permutations, a pure function of (step, seed).
    With `max_len`, each row is a random window of that many tokens (the taps along it keep the
    full left context they were computed with)."""
    n = len(self)
    first = step * batch_size
    idx = []
    while len(idx) < batch_size:
      epoch, off = divmod(first + len(idx), n)
      perm = np.random.default_rng([seed, epoch]).permutation(n)
      idx.extend(perm[off:off + batch_size - len(idx)].tolist())
    out = self.rows(np.asarray(idx), with_taps=with_taps)
    if max_len is not None and max_len < self.width:
      out = crop_rows(out, max_len, np.random.default_rng([seed, step, 1]))
    return out


def crop_rows(rows: dict[str, np.ndarray], max_len: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """A window of max_len tokens per row, starting uniformly in [0, len - max_len]."""
  lens = rows["lens"]
  start = (rng.random(len(lens)) * (np.maximum(lens - max_len, 0) + 1)).astype(np.int64)
  take = start[:, None] + np.arange(max_len)[None, :]                                  # [B, max_len]
  out = {"tokens": np.take_along_axis(rows["tokens"], take, axis=1),
         "lens": np.minimum(lens - start, max_len).astype(np.int32),
         "prompt_lens": np.clip(rows["prompt_lens"] - start, 0, max_len).astype(np.int32)}
  if "loss_mask" in rows:
    out["loss_mask"] = np.take_along_axis(rows["loss_mask"], take, axis=1)
  if "prenorm" in rows:
    out["prenorm"] = np.take_along_axis(rows["prenorm"], take[..., None], axis=1)
  return out


def response_mask(lens, prompt_lens, width: int, xp=np):
  """[n, W] bool: prompt_lens[r] <= p < lens[r] (the loss mask of prompt + response rows); `xp`:
  numpy, or jax.numpy inside a trace."""
  p = xp.arange(width)[None, :]
  return (p >= prompt_lens[:, None]) & (p < lens[:, None])


def batch_loss_mask(batch: dict):
  """[B, L] bool inside a loss function: the batch's `loss_mask` (what `ShardDataset` batches carry),
  else the response of prompt rows (a batch built by hand with tokens, lens, prompt_lens only)."""
  import jax.numpy as jnp
  if "loss_mask" in batch:
    return jnp.asarray(batch["loss_mask"]).astype(bool)
  return response_mask(batch["lens"], batch["prompt_lens"], batch["tokens"].shape[1], xp=jnp)
