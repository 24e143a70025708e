"""A generic training loop for drafter heads (MTP now; EAGLE-3 and DFlash plug in the same way).

What a head brings: its trainable parameters (a pytree, float32 master copy), a frozen pytree
(the target's parameters), a loss function and a batch source:

    loss_fn(params, frozen, batch, rng) -> (loss scalar, {metric name: scalar})
    get_batch(step) -> {name: numpy array}      # a pure function of the step: resumable

The loop owns everything else: AdamW with global-norm clipping and a warmup-cosine schedule, one
jitted step (params and optimizer state donated), orbax checkpoints every `ckpt_every` steps with
resume from the newest, metrics as JSON lines, held-out metrics every `eval_every` steps where the
head passes an `evaluate` function (their own JSON lines, `heldout.jsonl`; with `keep_best` the
parameters of the best held-out first-step accuracy come back beside the last), and a tqdm bar.
Batches are a function of the step
index (not an iterator's position), so a resumed run sees exactly the batches an uninterrupted
run would have seen, and ends with the same parameters.

With a `mesh` (`specjax.parallel`) the step is data-parallel: each batch is split over "data", the
frozen target is sharded like inference (its features are extracted tensor-parallel), the trained
head is replicated (its gradients are averaged by XLA's all-reduce), and checkpoints hold the
sharded arrays (orbax writes each shard from the device that has it, and restores onto the mesh).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax import parallel
from specjax.errors import UserError


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 1000                  # optimizer steps in total
  lr: float = 1e-3                   # peak learning rate
  warmup_steps: int = 50
  end_lr_ratio: float = 0.1          # cosine decays to lr * end_lr_ratio at `steps`
  weight_decay: float = 0.0
  clip_norm: float = 1.0
  b1: float = 0.9
  b2: float = 0.95
  seed: int = 0
  log_every: int = 10
  ckpt_every: int = 100
  keep_ckpts: int = 2
  eval_every: int = 0                # held-out metrics every this many steps (0: none; needs `evaluate`)
  keep_best: bool = False            # return the parameters with the best held-out acc_0 as `best`

  @staticmethod
  def from_dict(d: dict) -> "TrainConfig":
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise ValueError(f"unknown training option(s) {unknown}; known: {sorted(known)}")
    return TrainConfig(**d)


def schedule(tc: TrainConfig) -> optax.Schedule:
  warmup = min(tc.warmup_steps, max(tc.steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(0.0, tc.lr, warmup, max(tc.steps, warmup + 1),
                                            end_value=tc.lr * tc.end_lr_ratio)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  """AdamW with global-norm clipping, without its learning rate: the step scales by the scheduled
  rate, which it takes as an argument (so one compiled step serves every schedule and length)."""
  return _optimizer(tc.clip_norm, tc.b1, tc.b2, tc.weight_decay)


def _optimizer(clip_norm, b1, b2, weight_decay):
  return optax.chain(optax.clip_by_global_norm(clip_norm), optax.scale_by_adam(b1=b1, b2=b2),
                     optax.add_decayed_weights(weight_decay))


def make_train_step(loss_fn: Callable, tc: TrainConfig):
  """(optimizer, jitted step): step(params, opt_state, frozen, batch, step, lr, seed) ->
  (params, opt_state, metrics); params and optimizer state are donated."""
  return _train_step(loss_fn, tc.clip_norm, tc.b1, tc.b2, tc.weight_decay)


@functools.lru_cache(maxsize=16)
def _train_step(loss_fn, clip_norm, b1, b2, weight_decay):
  opt = _optimizer(clip_norm, b1, b2, weight_decay)

  def step_fn(params, opt_state, frozen, batch, step, lr, seed):
    rng = jax.random.fold_in(jax.random.key(seed), step)
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, frozen, batch, rng)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = jax.tree_util.tree_map(lambda p, u: p - lr * u.astype(p.dtype), params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads), lr=lr)
    return params, opt_state, metrics

  return opt, jax.jit(step_fn, donate_argnums=(0, 1))


# The in-memory layout of the parameters: the order of fused projection outputs (models/layers.py:
# q/k/v grouped per KV head, gate/up interleaved per unit) and the kernels' orientation ([out, in]).
# Checkpoints hold parameters so, a folder records it, and a resume from another layout is refused
# rather than silently permuting or transposing the weights (a square kernel loads either way).
FUSED_LAYOUT = "grouped-per-kv-head+gate-up-interleaved+kernels-out-in"


class Checkpoints:
  """Orbax checkpoints of {params, opt_state} per step under `directory` (beside them
  `fused_layout.txt`: the parameter layout they hold, `FUSED_LAYOUT`)."""

  def __init__(self, directory: str | Path, keep: int = 2):
    import orbax.checkpoint as ocp
    self._ocp = ocp
    self._layout_file = Path(directory).absolute() / "fused_layout.txt"
    self.manager = ocp.CheckpointManager(
        Path(directory).absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False))

  def latest(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, tree) -> None:
    self.manager.save(step, args=self._ocp.args.StandardSave(tree))
    self.manager.wait_until_finished()
    if jax.process_index() == 0 and not self._layout_file.exists():
      self._layout_file.write_text(FUSED_LAYOUT + "\n")

  def restore(self, step: int, like, sharded: bool = False):
    """The tree saved at `step`, shaped like `like`, as uncommitted arrays (as fresh ones are:
    committed arrays would make the jitted step compile a second time); with `sharded`, on the
    shardings of `like` (a run on a mesh), each device reading its own shards."""
    found = self._layout_file.read_text().strip() if self._layout_file.exists() else "columns side by side"
    if found != FUSED_LAYOUT:
      raise UserError(f"{self._layout_file.parent}: these checkpoints hold parameters laid out as {found!r}, "
                      f"this specjax keeps them as {FUSED_LAYOUT!r}; resuming would permute or transpose their "
                      "weights. Start a fresh run (another output folder) or resume with the specjax that wrote them")
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if sharded else None), like)
    tree = self.manager.restore(step, args=self._ocp.args.StandardRestore(abstract))
    return tree if sharded else jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x)), tree)

  def close(self):
    self.manager.close()


@dataclasses.dataclass
class TrainResult:
  params: Any
  step: int                          # steps done in total
  metrics: dict                      # the last logged metrics
  seconds: float                     # wall time of this call
  resumed_from: int | None
  best: dict | None = None           # keep_best: {"step", "metrics", "params" (host copy)} of this call's evaluations


def _host(metrics: dict) -> dict:
  return {k: float(np.asarray(v)) for k, v in metrics.items()}


def _event_writer(folder: Path, log_name: str):
  """TensorBoard event files beside metrics.jsonl (`tensorboard --logdir OUT/tensorboard`), one run
  folder per log (a training run's rounds keep separate curves)."""
  from tensorboardX import SummaryWriter
  return SummaryWriter(str(folder / Path(log_name).stem), flush_secs=30)


def train(loss_fn: Callable, params, frozen, get_batch: Callable[[int], dict], tc: TrainConfig,
          out_dir: str | Path, *, resume: bool = True, stop_at: int | None = None,
          progress: bool = True, log_name: str = "metrics.jsonl", mesh=None,
          evaluate: Callable[[Any], dict] | None = None) -> TrainResult:
  """Train `params` for `tc.steps` steps (or until `stop_at`, for a deliberately interrupted run),
  checkpointing to `out_dir/checkpoints` and logging to `out_dir/metrics.jsonl` (and TensorBoard
  event files under `out_dir/tensorboard`). `evaluate(params) -> {metric: number}` (held-out rows)
  runs every `tc.eval_every` steps and at the end, logged to `out_dir/heldout.jsonl` and TensorBoard
  (`heldout/...`). With `resume`,
  continue from the newest checkpoint there. `mesh` (a spec such as "data=2,model=2", or a Mesh):
  data-parallel training over it (`place_for_training`)."""
  from tqdm.auto import tqdm
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  opt, step_fn = make_train_step(loss_fn, tc)
  sched = schedule(tc)
  params = jax.tree_util.tree_map(jnp.array, params)    # a copy: the step donates its buffers
  mesh = parallel.as_mesh(mesh)
  params, frozen = place_for_training(params, frozen, mesh)
  opt_state = opt.init(params) if mesh is None else parallel.replicate(opt.init(params), mesh)   # as the head is
  ckpts = Checkpoints(out / "checkpoints", keep=tc.keep_ckpts)
  start, resumed = 0, None
  if resume and ckpts.latest() is not None:
    resumed = start = ckpts.latest()
    state = ckpts.restore(start, {"params": params, "opt_state": opt_state}, sharded=mesh is not None)
    params, opt_state = state["params"], state["opt_state"]
  end = tc.steps if stop_at is None else min(stop_at, tc.steps)
  log_path, held_path = out / log_name, out / "heldout.jsonl"
  for path in (log_path, held_path):
    if start == 0 and path.exists():
      path.unlink()
    elif path.exists():   # drop lines past the checkpoint (logged by a run that went on after it)
      lines = [ln for ln in path.read_text().split("\n") if ln and json.loads(ln)["step"] <= start]
      path.write_text("".join(ln + "\n" for ln in lines))
  best = None
  last: dict = {}
  t0 = time.perf_counter()
  bar = tqdm(total=tc.steps, initial=start, disable=not progress, desc="train", dynamic_ncols=True)
  pending = []   # (step, device metrics) not yet logged: fetching them every step would sync
  board = _event_writer(out / "tensorboard", log_name)
  with open(log_path, "a") as log:
    for step in range(start, end):
      batch = batch_on(get_batch(step), mesh)
      lr = jnp.float32(sched(step))
      params, opt_state, metrics = step_fn(params, opt_state, frozen, batch, jnp.int32(step), lr, jnp.uint32(tc.seed))
      pending.append((step + 1, metrics))
      done = step + 1
      if done % tc.log_every == 0 or done == end:
        for s, m in pending:
          last = {"step": s, **_host(m), "time": round(time.perf_counter() - t0, 3)}
          log.write(json.dumps(last) + "\n")
          for k, v in last.items():
            if k != "step":
              board.add_scalar(k, v, s)
        log.flush()
        board.flush()
        pending = []
        bar.set_postfix(loss=f"{last['loss']:.4f}", lr=f"{last['lr']:.2e}")
      bar.update(1)
      if done % tc.ckpt_every == 0 or done == end:
        ckpts.save(done, {"params": params, "opt_state": opt_state})
      if evaluate is not None and tc.eval_every and (done % tc.eval_every == 0 or done == end):
        best = _evaluated(evaluate, params, done, held_path, board, best, tc.keep_best)
  bar.close()
  board.close()
  ckpts.close()
  return TrainResult(params=params, step=end, metrics=last, seconds=time.perf_counter() - t0,
                     resumed_from=resumed, best=best)


def _evaluated(evaluate, params, step: int, path: Path, board, best, keep: bool):
  """Held-out metrics of `params` at `step`, logged; -> the best evaluation so far by acc_0 (with a
  host copy of its parameters when `keep`)."""
  m = {k: float(v) for k, v in evaluate(params).items()}
  with open(path, "a") as f:
    f.write(json.dumps({"step": step, **m}) + "\n")
  for k, v in m.items():
    board.add_scalar(f"heldout/{k}", v, step)
  board.flush()
  if best is None or m.get("acc_0", 0.0) > best["metrics"].get("acc_0", 0.0):
    best = {"step": step, "metrics": m, "params": jax.device_get(params) if keep else None}
  return best


def place_for_training(params, frozen, mesh):
  """(trained params replicated, frozen tree sharded by parameter path) on `mesh`; as they are
  without one. Replicated heads keep the optimizer step local (no sharded optimizer state)."""
  if mesh is None:
    return params, frozen
  from specjax.parallel import partition
  return parallel.replicate(params, mesh), partition.place(frozen, partition.param_shardings(frozen, mesh))


def batch_on(batch: dict, mesh) -> dict:
  """A host batch {name: [B, ...]} as device arrays: rows split over "data" on a mesh (data must
  divide the batch size), one device without."""
  if mesh is None:
    return {k: jnp.asarray(v) for k, v in batch.items()}
  data = parallel.axis_size(mesh, parallel.DATA)
  bad = {k: np.shape(v)[0] for k, v in batch.items() if np.ndim(v) and np.shape(v)[0] % data}
  if bad:
    raise ValueError(f"the batch rows {bad} must divide by the mesh's data axis ({data})")
  return parallel.shard_batch(dict(batch), mesh)


def plot_metrics(jsonl: str | Path, out_png: str | Path, title: str = "") -> Path:
  """Training curves from a metrics.jsonl: every `loss*` and every `acc*` metric against the step,
  and the held-out loss_0 / acc_0 of heldout.jsonl beside it where training evaluated them."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [json.loads(ln) for ln in Path(jsonl).read_text().splitlines() if ln.strip()]
  steps = np.asarray([r["step"] for r in rows])
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  held_path = Path(jsonl).with_name("heldout.jsonl")      # held-out evaluations during training, if any
  held = [json.loads(ln) for ln in held_path.read_text().split("\n") if ln.strip()] if held_path.exists() else []
  for ax, prefix in zip(axes, ("loss", "acc")):
    for key in sorted(k for k in rows[-1] if k.startswith(prefix)):
      ys = np.asarray([r.get(key, np.nan) for r in rows], float)
      win = max(1, len(ys) // 50)
      smooth = np.convolve(ys, np.ones(win) / win, mode="valid")
      ax.plot(steps[win - 1:], smooth, label=key, lw=1.2)
    if held and f"{prefix}_0" in held[-1]:
      ax.plot([h["step"] for h in held], [h[f"{prefix}_0"] for h in held], "ko--", ms=4, lw=1,
              label=f"held-out {prefix}_0")
    ax.set(xlabel="step", title=f"{prefix} (moving average)")
    ax.legend(fontsize=8)
  axes[2].plot(steps, [r["lr"] for r in rows], color="k", lw=1)
  axes[2].set(xlabel="step", title="learning rate")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(out_png, dpi=110)
  plt.close(fig)
  return Path(out_png)
