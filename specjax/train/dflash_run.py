"""Running a DFlash training (`specjax train dflash`): the datasets built within a data budget,
the rows answering held-out evaluation prompts dropped, an optional warm start from a trained
drafter, training shortened to fit a wall budget, then the export, the scores on held-out data, the
summary and the training curve. What is trained and its loss: `specjax.train.dflash`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.dflash import DFlashConfig, init_dflash, save_dflash
from specjax.models.config import ModelConfig
from specjax.train.data import heldout_scores
from specjax.train.dflash import DFlashTrainSpec, HeldOut, make_loss_fn
from specjax.train.loop import TrainConfig


def build_data(target, dcs, *, seconds: float | None = None, progress: bool = True, dtype_name=None) -> list[Path]:
  """Build the datasets `dcs` (the main one first). With `seconds`, the main dataset grows shard by
  shard until the budget would be exceeded (timed on its first two shards), the others in full."""
  from specjax.train.data import build_dataset
  t0 = time.perf_counter()
  main, extras = dcs[0], list(dcs[1:])
  out = [build_dataset(target, dc, progress=progress, dtype_name=dtype_name) for dc in extras]
  if seconds is None:
    return [build_dataset(target, main, progress=progress, dtype_name=dtype_name)] + out
  bs = main.batch_size
  n = min(bs, main.n_sequences)
  build_dataset(target, dataclasses.replace(main, n_sequences=n), progress=progress, dtype_name=dtype_name)
  if n < main.n_sequences:
    t1 = time.perf_counter()
    n = min(2 * bs, main.n_sequences)
    build_dataset(target, dataclasses.replace(main, n_sequences=n), progress=progress, dtype_name=dtype_name)
    per_shard = time.perf_counter() - t1
    more = int(max(seconds - (time.perf_counter() - t0), 0) // max(per_shard, 1e-3))
    n = min(n + more * bs, main.n_sequences)
  path = build_dataset(target, dataclasses.replace(main, n_sequences=n), progress=progress, dtype_name=dtype_name)
  return [path] + out


def train_within(loss_fn, params, frozen, get_batch, tc: TrainConfig, out_dir, *, seconds: float | None,
                 resume: bool = True, progress: bool = True):
  """`specjax.train.loop.train`, shortened to fit `seconds` of wall time (compilation included): 3
  steps compile, the next few are timed (from the loop's own metrics log: checkpointing is not
  counted), then the run is set to the steps that fit, so the cosine schedule ends there (the warmup
  is unchanged when it is longer than the timed steps). Returns the loop's TrainResult."""
  from specjax.train.loop import train
  timed = min(20, max(5, tc.steps // 10))
  if seconds is None or tc.steps <= 3 + timed:
    return train(loss_fn, params, frozen, get_batch, tc, out_dir, resume=resume, progress=progress)
  t0 = time.perf_counter()
  first = train(loss_fn, params, frozen, get_batch, tc, out_dir, resume=resume, progress=progress, stop_at=3)
  res = train(loss_fn, params, frozen, get_batch, tc, out_dir, resume=True, progress=progress,
              stop_at=first.step + timed)
  if res.step <= first.step or "time" not in res.metrics:   # resumed past the timed steps: nothing to time
    return res if res.step >= tc.steps else train(loss_fn, params, frozen, get_batch, tc, out_dir, resume=True,
                                                  progress=progress)
  per_step = res.metrics["time"] / (res.step - first.step)
  steps = min(tc.steps, res.step + int(max(seconds - (time.perf_counter() - t0), 0) / per_step))
  if progress:
    print(f"[train dflash] {per_step * 1e3:.1f} ms/step: {steps} steps fit {seconds:.0f} s", flush=True)
  if steps <= res.step:
    return res
  return train(loss_fn, params, frozen, get_batch, dataclasses.replace(tc, steps=steps), out_dir, resume=True,
               progress=progress)


def held_out_mask(tokens: np.ndarray, prompt_lens: np.ndarray, prompts: Sequence[Sequence[int]]) -> np.ndarray:
  """[n] bool: rows whose prompt (tokens[:prompt_len]) is exactly one of `prompts` (token lists)."""
  held = {tuple(int(t) for t in p) for p in prompts}
  return np.asarray([tuple(tokens[r, :prompt_lens[r]].tolist()) in held for r in range(len(tokens))], bool)


class RowSubset:
  """The rows `keep` of a ShardDataset, batched the same way (epoch-wise permutations)."""

  def __init__(self, ds, keep: np.ndarray):
    self.ds, self.keep = ds, np.asarray(keep, np.int64)

  def __len__(self) -> int:
    return len(self.keep)

  @property
  def width(self) -> int:
    return self.ds.width

  @property
  def n_response_tokens(self) -> int:
    return int(self.ds.arrays["loss_mask"][self.keep].sum())

  def rows(self, idx, with_taps: bool = True):
    return self.ds.rows(self.keep[np.asarray(idx)], with_taps=with_taps)

  def batch(self, step: int, batch_size: int, seed: int = 0, with_taps: bool = True, max_len: int | None = None):
    from specjax.train.data import ShardDataset
    return ShardDataset.batch(self, step, batch_size, seed=seed, with_taps=with_taps, max_len=max_len)


def without_held_out(ds, target, held_out: Sequence[HeldOut]):
  """(the rows of `ds` that answer none of the held-out prompts (chat-encoded as the data builder
  encodes them), number of rows dropped)."""
  if not held_out:
    return ds, 0
  from specjax.bench.prompts import load_prompt_set
  tok = target.tokenizer
  prompts = [tok.encode_chat([{"role": "user", "content": q.turns[0]}])
             for h in held_out for q in load_prompt_set(h.name, limit=h.first)]
  drop = held_out_mask(ds.arrays["tokens"], ds.arrays["prompt_lens"], prompts)
  return RowSubset(ds, np.flatnonzero(~drop)), int(drop.sum())


def _tree_size(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


END_RESERVE_S = 30.0   # a wall budget keeps this for the export, the held-out scoring and the plot


def warm_start(dparams: dict, path: str | Path, cfg: ModelConfig, dc: DFlashConfig) -> dict:
  """`dparams` (a fresh init for `dc`) with the trained drafter at `path` copied in: fc, hidden_norm,
  the MASK embedding and its layers; layers beyond the trained drafter's keep their init, whose
  output projections are zero, so the warm-started drafter computes what the trained one computes."""
  from specjax.drafters.dflash import load_dflash
  old, dc0, _ = load_dflash(path, cfg, dtype=jnp.float32)
  same = lambda a, b: (a.taps, a.block_size, a.ffn_dim or cfg.ffn_dim) == (b.taps, b.block_size, b.ffn_dim or cfg.ffn_dim)
  if not same(dc0, dc) or dc0.n_layers > dc.n_layers:
    raise ValueError(f"drafter.init_from {path}: {dc0} does not fit the config's drafter {dc} (taps, block_size "
                     f"and ffn_dim must match; it may have fewer layers)")
  out = dict(dparams)
  for key in ("fc", "hidden_norm", "mask_embedding", "norm"):
    if key in old and key in out:
      out[key] = old[key]
  out["layers"] = {i: (old["layers"][i] if i < dc0.n_layers else layer) for i, layer in dparams["layers"].items()}
  return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), out)


def score_blocks(loss_fn, dparams, tparams, ds, idx, batch_size: int) -> dict:
  """The loss function's metrics (top-1 accuracy per block slot, tau_est, loss) over rows `idx` of
  `ds`, anchors drawn with fixed keys, batch means weighted by their blocks; the last batch padded
  with empty rows (no anchor)."""
  fn = jax.jit(loss_fn)
  tot, blocks = {}, 0.0
  for b, i in enumerate(range(0, len(idx), batch_size)):
    rows = ds.rows(np.asarray(idx[i:i + batch_size]), with_taps=False)
    pad = batch_size - len(rows["lens"])
    if pad:
      rows = {k: np.concatenate([v, np.repeat(v[:1], pad, axis=0)]) for k, v in rows.items()}
      rows["lens"][-pad:] = 1
      if "loss_mask" in rows:
        rows["loss_mask"][-pad:] = False
    loss, m = fn(dparams, tparams, {k: jnp.asarray(v) for k, v in rows.items()}, jax.random.key(b))
    m = {**{k: float(v) for k, v in m.items()}, "loss": float(loss)}
    for k, v in m.items():
      if k.startswith("acc_") or k in ("tau_est", "loss"):
        tot[k] = tot.get(k, 0.0) + m["blocks"] * v
    blocks += m["blocks"]
  return {**{k: round(v / max(blocks, 1.0), 4) for k, v in sorted(tot.items())}, "rows": int(len(idx)),
          "blocks": int(blocks)}


def build_budgeted(spec: DFlashTrainSpec, target, *, progress: bool = True) -> tuple[DFlashTrainSpec, dict]:
  """Build the held-out datasets and the main dataset, then the extra datasets in order while
  `data_budget_s` (counted from the start) allows (`specjax.train.data.build_within`).
  -> (the spec restricted to the datasets built, {dir: seconds or "skipped"})."""
  from specjax.train.data import build_within
  extra, built = build_within(target, spec.extra_data, spec.data_budget_s, progress=progress,
                              dtype_name=spec.dtype, forced=spec.heldout_data + (spec.data,))
  return dataclasses.replace(spec, extra_data=tuple(extra)), built


def run_training(spec: DFlashTrainSpec, *, resume: bool = True, progress: bool = True, target=None,
                 t_start: float | None = None, data_log: dict | None = None) -> dict:
  """Train the drafter of `spec` on its datasets; export it; score it on `heldout_data`; write
  summary.json and the training curve into out_dir; return the summary. `t_start` (perf_counter
  seconds) is when the run began, for `wall_budget_s` (default: now); `data_log` (how the data was
  built) goes into the summary."""
  from specjax.bench.env import device_info, git_revision
  from specjax.models.load import load_model, require_unpadded
  from specjax.train.data import ShardDataset

  t_start = time.perf_counter() if t_start is None else t_start
  dtype = jnp.dtype(spec.dtype)
  target = target or load_model(spec.target, dtype=dtype, progress=progress)
  require_unpadded(target, "DFlash drafter training")
  cfg = target.cfg
  dc = spec.drafter.resolve(cfg)
  dirs = [spec.data.dir] + [e.dir for e in spec.extra_data]
  ds, n_held = without_held_out(ShardDataset(dirs), target, spec.held_out)
  dparams = init_dflash(cfg, dc, seed=spec.train.seed, dtype=jnp.float32, target_params=target.params)
  start = spec.drafter.init_from if spec.drafter.init_from and Path(spec.drafter.init_from).exists() else None
  if spec.drafter.init_from and start is None and progress:
    print(f"[train dflash] no drafter at {spec.drafter.init_from}: starting from scratch", flush=True)
  if start:
    dparams = warm_start(dparams, start, cfg, dc)
  seconds = spec.train_seconds
  if spec.wall_budget_s:
    left = t_start + spec.wall_budget_s - END_RESERVE_S - time.perf_counter()
    seconds = left if seconds is None else min(seconds, left)
  loss_fn = make_loss_fn(cfg, dc, spec.loss, dtype)
  bs = spec.loss.batch_size
  get_batch = lambda step: ds.batch(step, bs, seed=spec.train.seed, with_taps=False, max_len=spec.loss.max_len)
  if progress:
    print(f"[train dflash] {len(ds)} rows ({n_held} held out), {ds.n_response_tokens} response tokens; "
          f"drafter {dc} of "
          f"{_tree_size(dparams) / 1e6:.2f}M params; up to {spec.train.steps} steps of {bs} rows x "
          f"{spec.loss.anchors_per_row} blocks ({spec.dtype})"
          + (f", from {start}" if start else "") + (f", {seconds:.0f} s" if seconds else ""), flush=True)
  if not resume:   # start over: old checkpoints would be resumed from by the timed chunks
    import shutil
    shutil.rmtree(Path(spec.out_dir) / "checkpoints", ignore_errors=True)
  t0 = time.perf_counter()
  res = train_within(loss_fn, dparams, target.params, get_batch, spec.train, spec.out_dir,
                     seconds=seconds, resume=resume, progress=progress)
  out = Path(spec.out_dir)
  logged = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
  summary = {"name": spec.name, "target": spec.target, "dtype": spec.dtype, "steps": res.step,
             "final_metrics": res.metrics or (logged[-1] if logged else {}),
             "seconds_this_run": round(time.perf_counter() - t0, 1),
             "resumed_from": res.resumed_from, "init_from": start, "drafter": dataclasses.asdict(dc),
             "params": _tree_size(dparams),
             "dataset": {"dirs": dirs, "rows": len(ds), "held_out_rows": n_held,
                         "response_tokens": ds.n_response_tokens, "build": data_log},
             "config": dataclasses.asdict(spec), "git_revision": git_revision(), "device": device_info(),
             "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
  if spec.export:
    w, c = save_dflash(spec.export, res.params, cfg, dc, extra={"training": summary})
    summary["export"] = {"weights": str(w), "config": str(c), "bytes": w.stat().st_size}
  held_dirs = [dc_.dir for dc_ in spec.heldout_data]
  if held_dirs and all((Path(h) / "manifest.json").exists() for h in held_dirs):
    summary["heldout"] = heldout_scores(lambda d, idx: score_blocks(loss_fn, res.params, target.params, d, idx, bs),
                                        ds, held_dirs, spec.train.seed)
    if progress:
      h = summary["heldout"]
      for k, m in [(k, h[k]) for k in ("heldout_rows", "training_rows")] + list(h.get("per_dir", {}).items()):
        print(f"[train dflash] {k}: tau_est {m['tau_est']}, acc {[m[f'acc_{j:02d}'] for j in (1, 2, 3, 4, 8)]}, "
              f"{m['rows']} rows", flush=True)
  (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
  if logged:
    plot_curve(out / "metrics.jsonl", out / "training_curve.png",
               title=f"{spec.name}: DFlash on {spec.target}, {res.step} steps")
  return summary


def plot_curve(jsonl: str | Path, out_png: str | Path, title: str = "") -> Path:
  """Training curve: loss, top-1 accuracy of a few block slots, tau_est and the learning rate."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [json.loads(ln) for ln in Path(jsonl).read_text().splitlines() if ln.strip()]
  steps = np.asarray([r["step"] for r in rows])
  win = max(1, len(rows) // 50)
  smooth = lambda key: np.convolve([r.get(key, np.nan) for r in rows], np.ones(win) / win, mode="valid")
  fig, axes = plt.subplots(1, 4, figsize=(18, 4))
  axes[0].plot(steps[win - 1:], smooth("loss"), lw=1.2)
  axes[0].set(xlabel="step", title="loss (moving average)")
  slots = sorted(k for k in rows[-1] if k.startswith("acc_"))
  for key in [s for i, s in enumerate(slots) if i in (0, 1, 3, 7) or i == len(slots) - 1]:
    axes[1].plot(steps[win - 1:], smooth(key), label=f"slot {int(key[4:])}", lw=1.2)
  axes[1].set(xlabel="step", title="top-1 accuracy by block slot")
  axes[1].legend(fontsize=8)
  axes[2].plot(steps[win - 1:], smooth("tau_est"), lw=1.2, color="C3")
  axes[2].set(xlabel="step", title="tau_est (greedy tokens per round on training blocks)")
  axes[3].plot(steps, [r["lr"] for r in rows], color="k", lw=1)
  axes[3].set(xlabel="step", title="learning rate")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(out_png, dpi=110)
  plt.close(fig)
  return Path(out_png)
