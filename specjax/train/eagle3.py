"""Training EAGLE-3 heads with the training-time test (TTT), target frozen.

The target runs inside the loss (its taps are recomputed: a forward of a 135M target costs less
than reading three stored [L, d_model] taps per row). Then, for every base position i of a row at
once, the head drafts `n_steps` steps exactly as `specjax/drafters/eagle3_drafter.py` does:
  step 0: the committed entries (g_i, x_{i+1}) at positions i, causal                 -> o^0_i
  step j: (o^{j-1}_i, x_{i+j+1}) at position i + j, attending to the committed entries
          at positions <= i and to its own steps 1..j at the same base i (the diagonal) -> o^j_i
Step j's output at base i drafts x_{i+j+2}. Teacher forcing on tokens (the data tokens are what
the drafter's accepted drafts are), the head's own hidden states fed back (what EAGLE-3 adds over
EAGLE: the head learns to read its own outputs, not the target's features).

Per step the loss is the soft cross-entropy of the head's draft-vocabulary distribution against
the target's distribution at that position restricted to the draft vocabulary (renormalised);
positions whose target argmax lies outside the draft vocabulary are left out (as EAGLE-3 does),
over response tokens (or every token, `train_on_prompt`), weighted `step_weight ** j`.

The diagonal attention is computed as it is, a dot product per position and step, instead of
masked [L, L] blocks per step: memory and time grow with n_steps, not n_steps x L.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.eagle3 import (Eagle3Config, build_d2t, head_module, init_head, load_head, save_head,
                                     t2d_mask)
from specjax.models.decoder import embed_tokens, forward, logits_from_prenorm
from specjax.models.layers import NEG_INF, attend
from specjax.models.kv_cache import KVCache
from specjax.train.data import DataConfig, build_within, heldout_scores
from specjax.train.loop import TrainConfig
from specjax.train.mtp import _cast, _shift_left, _shift_right
from specjax.train.shards import batch_loss_mask

EVAL_ROWS = 256          # held-out rows scored every train.eval_every steps


@dataclasses.dataclass(frozen=True)
class Eagle3HeadConfig:
  draft_vocab: int = 8192            # most frequent target tokens of the training data (+ EOS)
  ffn_dim: int | None = None         # the head layer's MLP width (default: the target's)
  tap_layers: tuple[int, ...] | None = None   # target layer outputs fused as low/mid/high (default: EAGLE-3's)
  init_lm_head: str = "target"       # "target": final norm + LM head start as the target's rows; "random"
  init_from: str | None = None       # start from this trained head file instead (its draft vocabulary and
                                     # shape must be the ones above); skipped with a note if it is missing


@dataclasses.dataclass(frozen=True)
class Eagle3LossConfig:
  n_steps: int = 7                   # drafting steps unrolled (the training-time test)
  step_weight: float = 0.8           # step j weighs step_weight ** j
  train_on_prompt: bool = False      # also predict prompt tokens
  batch_size: int = 16
  max_len: int | None = None         # train on random windows of this many tokens of each row
  positions_per_row: int | None = None   # draft LM head (and loss) at this many random positions per row


@dataclasses.dataclass(frozen=True)
class Eagle3TrainSpec:
  """One YAML file: data, head, loss, optimizer."""
  name: str
  target: str = "smollm2-135m-instruct"
  dtype: str = "float32"             # the target's (and the compute) dtype: bfloat16 on GPU
  out_dir: str = "out/eagle3"        # checkpoints, metrics.jsonl, d2t.npy, summary.json
  export: str | None = None          # where the trained head goes (safetensors + json)
  time_budget_s: float | None = None # cap train.steps so training takes about this long (measured)
  wall_budget_s: float | None = None # the whole run (load, data, compilation, training, export, scoring)
                                     # in about this long: training gets what is left (END_RESERVE_S kept)
  data_budget_s: float | None = None # datasets still to generate are built in order while the next one
                                     # is predicted to fit (the last generated one's time); the rest are
                                     # left out of training
  data: DataConfig = DataConfig(store_taps=False)
  extra_data: tuple[DataConfig, ...] = ()
  heldout_data: tuple[DataConfig, ...] = ()   # built first, never trained on: the trained head is
                                     # scored on them and on as many training rows (over-fitting)
  head: Eagle3HeadConfig = Eagle3HeadConfig()
  loss: Eagle3LossConfig = Eagle3LossConfig()
  train: TrainConfig = TrainConfig()


def load_spec(path: str | Path, **overrides) -> Eagle3TrainSpec:
  """The spec of a YAML file; `overrides` as {"train.steps": 10, "dtype": "bfloat16"} (None: keep)."""
  from specjax.bench.config import ConfigError
  from specjax.train.spec import load_train_spec
  path = Path(path)
  spec = load_train_spec(Eagle3TrainSpec, path, overrides)
  if spec.head.init_lm_head not in ("target", "random"):
    raise ConfigError(f"{path.name}: head.init_lm_head must be 'target' or 'random'")
  if spec.loss.n_steps < 1:
    raise ConfigError(f"{path.name}: loss.n_steps must be >= 1")
  trained = {dc.dir for dc in (spec.data,) + spec.extra_data}
  if any(dc.dir in trained for dc in spec.heldout_data):
    raise ConfigError(f"{path.name}: a heldout_data dir is also trained on")
  return spec


# ----------------------------------------------------------------------------------------------
# the training-time test


def ttt_attend(q, k0, v0, diag_k, diag_v, scale: float):
  """Attention of step-j queries q [B, L, H, hd] (base i at row i) over the committed entries
  k0, v0 [B, L, KVH, hd] at positions <= i and the same base's step entries diag_k/diag_v (lists
  of [B, L, KVH, hd], steps 1..j). -> [B, L, H, hd]."""
  b, t, h, d = q.shape
  kvh = k0.shape[2]
  qg = q.reshape(b, t, kvh, h // kvh, d).astype(k0.dtype)                          # [B, L, KVH, G, hd]
  causal = jnp.tril(jnp.ones((t, t), bool))
  s0 = jnp.einsum("btkgd,bskd->bkgts", qg, k0, preferred_element_type=jnp.float32) * scale
  s0 = jnp.where(causal, s0, NEG_INF)                                              # [B, KVH, G, L, L]
  sd = jnp.stack([jnp.einsum("btkgd,btkd->bkgt", qg, kk, preferred_element_type=jnp.float32)
                  for kk in diag_k], axis=-1) * scale                              # [B, KVH, G, L, J]
  probs = jax.nn.softmax(jnp.concatenate([s0, sd], axis=-1), axis=-1)
  p0, pd = probs[..., :t].astype(v0.dtype), probs[..., t:].astype(v0.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", p0, v0, preferred_element_type=jnp.float32)
  out = out + jnp.einsum("bkgtj,jbtkd->btkgd", pd, jnp.stack(diag_v), preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, d)


def ttt_outputs(hp, hc: Eagle3Config, tparams, tokens, layer_taps, n_steps: int) -> list[jax.Array]:
  """Head outputs o^j [B, L, D] for steps j < n_steps at every base position (module doc).
  tokens [B, L]; layer_taps: the target's tapped hidden states along them (decoder order)."""
  head = head_module(hp, hc)
  layer, scale = head.midlayer, hc.layer.scale
  b, length = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None, :], (b, length))
  g = head.fuse(layer_taps)                                                        # [B, L, D]
  emb = embed_tokens(tparams, hc.target, _shift_left(tokens, 1))                   # x_{i+1}
  q, k0, v0 = layer.project(emb, g, pos)
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool))[None], (b, length, length))
  outs = [layer.finish(g, attend(q, k0, v0, causal, scale))]
  diag_k, diag_v = [], []
  for j in range(1, n_steps):
    emb = embed_tokens(tparams, hc.target, _shift_left(tokens, j + 1))             # x_{i+j+1}
    q, k, v = layer.project(emb, outs[-1], pos + j)
    diag_k.append(k)
    diag_v.append(v)
    outs.append(layer.finish(outs[-1], ttt_attend(q, k0, v0, diag_k, diag_v, scale)))
  return outs


@functools.lru_cache(maxsize=16)
def make_loss_fn(hc: Eagle3Config, lc: Eagle3LossConfig, compute_dtype):
  """loss_fn(head params, {"target": params, "d2t": [Vd]}, batch, rng) -> (loss, metrics) for
  `specjax.train.loop.train`; batch: tokens [B, L], lens [B], loss_mask [B, L] (else prompt_lens [B]:
  the response is learned). Cached, so the
  loop's jitted step is reused across calls with the same arguments."""

  def step_loss(hp, o, t_prob, labels, valid):
    logits = head_module(hp, hc).logits(o)                                          # [B, P, Vd] f32
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.sum(t_prob * logp, axis=-1)                                          # soft cross-entropy
    n = jnp.maximum(jnp.sum(valid), 1)
    hit = (jnp.argmax(logits, axis=-1) == labels) & valid
    return jnp.sum(jnp.where(valid, nll, 0.0)) / n, jnp.sum(hit) / n

  step_loss = jax.checkpoint(step_loss)   # keep no [B, P, Vd] logits alive for the backward pass

  def loss_fn(hp, frozen, batch, rng):
    tparams, d2t = frozen["target"], frozen["d2t"]
    tokens, lens = batch["tokens"], batch["lens"]
    b, length = tokens.shape
    cache = KVCache.init(hc.target, b, length, dtype=jax.tree_util.tree_leaves(tparams)[0].dtype)
    _, tapped, _ = forward(tparams, hc.target, tokens, cache, n_new=lens, taps=hc.taps)
    tapped = jax.lax.stop_gradient(tapped)
    hp_c = _cast(hp, compute_dtype)
    outs = ttt_outputs(hp_c, hc, tparams, tokens, tapped["layers"], lc.n_steps)
    # Step j's output at base i drafts the token after position p = i + j + 1: the target's distribution at p.
    p = jnp.broadcast_to(jnp.arange(length)[None, :], (b, length))
    wanted = (p + 1 < lens[:, None]) & (_shift_left(batch_loss_mask(batch), 1) | lc.train_on_prompt)
    if lc.positions_per_row:   # the LM heads only at a random sample of positions (they dominate the cost)
      score = jnp.where(wanted, jax.random.uniform(rng, (b, length)), -1.0)
      _, idx = jax.lax.top_k(score, min(lc.positions_per_row, length))              # [B, P]
      sel = lambda x: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
    else:
      sel = lambda x: x
    tlogits = jax.lax.stop_gradient(logits_from_prenorm(tparams, hc.target, sel(tapped["prenorm"])))   # [B, P, V]
    t_draft = jnp.take(tlogits, d2t, axis=-1)                                       # [B, P, Vd]
    t_prob = jax.nn.softmax(t_draft, axis=-1)
    labels = jnp.argmax(t_draft, axis=-1)
    in_vocab = t2d_mask(d2t, hc.target.vocab_size)[jnp.argmax(tlogits, axis=-1)]     # [B, P]
    total, wsum, metrics = 0.0, 0.0, {}
    for j, o in enumerate(outs):
      valid = sel(wanted & (p >= j + 1)) & in_vocab
      l_j, acc_j = step_loss(hp_c, sel(_shift_right(o, j + 1)), t_prob, labels, valid)
      w = lc.step_weight ** j
      total, wsum = total + w * l_j, wsum + w
      metrics[f"loss_{j}"], metrics[f"acc_{j}"] = l_j, acc_j
    metrics["tokens"] = jnp.sum(sel(wanted)).astype(jnp.float32)
    metrics["in_vocab"] = jnp.sum(sel(wanted) & in_vocab) / jnp.maximum(metrics["tokens"], 1.0)
    return total / wsum, metrics

  return loss_fn


# ----------------------------------------------------------------------------------------------
# the command


def _tree_size(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


END_RESERVE_S = 30.0   # a wall budget keeps this for the export, the held-out scoring (its compilation) and the plot


def _measured_steps(loss_fn, tc: TrainConfig, hp, frozen, get_batch, budget_s: float | None, progress: bool,
                    deadline: float | None = None) -> int:
  """Steps that fit `budget_s` seconds of training and end by `deadline` (perf_counter seconds) less
  END_RESERVE_S: the jitted step (the one `train` will reuse) is compiled and timed on copies of the
  parameters."""
  from specjax.train.loop import make_train_step
  opt, step_fn = make_train_step(loss_fn, tc)
  batch = {k: jnp.asarray(v) for k, v in get_batch(0).items()}
  copy = lambda: jax.tree_util.tree_map(jnp.array, hp)
  params = copy()
  state = opt.init(params)
  t0 = time.perf_counter()
  params, state, m = step_fn(params, state, frozen, batch, jnp.int32(0), jnp.float32(0.0), jnp.uint32(0))
  jax.block_until_ready(m["loss"])
  compile_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  for i in range(3):
    params, state, m = step_fn(params, state, frozen, batch, jnp.int32(i), jnp.float32(0.0), jnp.uint32(0))
  jax.block_until_ready(m["loss"])
  per_step = (time.perf_counter() - t0) / 3
  if deadline is not None:
    left = deadline - END_RESERVE_S - time.perf_counter()
    budget_s = left if budget_s is None else min(budget_s, left)
  steps = max(1, min(tc.steps, int(budget_s / per_step)))
  if progress:
    print(f"[train eagle3] step compiled in {compile_s:.1f} s, {per_step * 1e3:.1f} ms/step: {steps} steps fit "
          f"{budget_s:.0f} s", flush=True)
  return steps


def score_rows(loss_fn, hp, frozen, ds, idx, batch_size: int) -> dict:
  """The loss function's metrics over rows `idx` of `ds` (whole rows, no window), batch means
  weighted by their in-vocabulary answer tokens; the last batch padded with empty rows."""
  fn = jax.jit(loss_fn)
  tot, weight, tokens = {}, 0.0, 0.0
  for i in range(0, len(idx), batch_size):
    rows = ds.rows(np.asarray(idx[i:i + batch_size]), with_taps=False)
    pad = batch_size - len(rows["lens"])
    if pad:
      rows = {k: np.concatenate([v, np.repeat(v[:1], pad, axis=0)]) for k, v in rows.items()}
      rows["lens"][-pad:] = 1     # no position to score
    _, m = fn(hp, frozen, {k: jnp.asarray(v) for k, v in rows.items()}, jax.random.key(0))
    m = {k: float(v) for k, v in m.items()}
    w = m["tokens"] * m["in_vocab"]
    for k, v in m.items():
      if k.startswith(("acc_", "loss_")):
        tot[k] = tot.get(k, 0.0) + w * v
    weight, tokens = weight + w, tokens + m["tokens"]
  out = {k: round(v / max(weight, 1.0), 4) for k, v in sorted(tot.items())}
  return {**out, "rows": int(len(idx)), "tokens": int(tokens), "in_vocab": round(weight / max(tokens, 1.0), 4)}


def run_training(spec: Eagle3TrainSpec, *, resume: bool = True, progress: bool = True, target=None,
                 stop_at: int | None = None, build_data: bool = True) -> dict:
  """Build the datasets of `spec` if needed (resumable), train the head, export it; return a
  summary (also `out_dir/summary.json`)."""
  from specjax.bench.env import device_info, git_revision
  from specjax.models.load import load_model, require_unpadded
  from specjax.train.data import ShardDataset
  from specjax.train.loop import plot_metrics, train

  t_start = time.perf_counter()
  deadline = t_start + spec.wall_budget_s if spec.wall_budget_s else None
  dtype = jnp.dtype(spec.dtype)
  target = target or load_model(spec.target, dtype=dtype, progress=progress)
  require_unpadded(target, "EAGLE-3 head training")
  cfg = target.cfg
  dcs, built = (spec.data,) + spec.extra_data, {}
  if build_data:
    dcs, built = build_within(target, dcs, spec.data_budget_s, progress=progress, dtype_name=spec.dtype,
                              forced=spec.heldout_data)
  data_s = time.perf_counter() - t_start
  ds = ShardDataset([dc.dir for dc in dcs])
  out = Path(spec.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  d2t_path = out / "d2t.npy"
  start = spec.head.init_from if spec.head.init_from and Path(spec.head.init_from).exists() else None
  if spec.head.init_from and start is None and progress:
    print(f"[train eagle3] no head at {spec.head.init_from}: starting from scratch", flush=True)
  if start:
    hp0, d2t, hc0, _ = load_head(start, cfg, dtype=jnp.float32)
    want = Eagle3Config.make(cfg, len(d2t), spec.head.ffn_dim, spec.head.tap_layers)
    if hc0 != want or len(d2t) != min(spec.head.draft_vocab, cfg.vocab_size):
      raise ValueError(f"head.init_from {start}: draft vocabulary {len(d2t)}, ffn {hc0.ffn_dim}, taps "
                       f"{hc0.tap_layers} differ from the config's head section")
    np.save(d2t_path, d2t)
  elif resume and d2t_path.exists():   # the checkpoints were trained with this vocabulary
    d2t = np.load(d2t_path)
  else:
    a = ds.arrays
    eos = tuple(target.tokenizer.eos_ids) if target.tokenizer is not None else ()
    d2t = build_d2t((t[:n] for t, n in zip(a["tokens"], a["lens"])), cfg.vocab_size,
                    min(spec.head.draft_vocab, cfg.vocab_size), always=eos)
    np.save(d2t_path, d2t)
  hc = Eagle3Config.make(cfg, len(d2t), spec.head.ffn_dim, spec.head.tap_layers)
  if start:
    hp = hp0
  else:
    hp = init_head(hc, seed=spec.train.seed, dtype=jnp.float32, d2t=d2t,
                   target_params=target.params if spec.head.init_lm_head == "target" else None)
  frozen = {"target": target.params, "d2t": jnp.asarray(d2t, jnp.int32)}
  loss_fn = make_loss_fn(hc, spec.loss, dtype)
  bs = spec.loss.batch_size
  get_batch = lambda step: ds.batch(step, bs, seed=spec.train.seed, with_taps=False, max_len=spec.loss.max_len)
  tc = spec.train
  plan_path = out / "plan.json"
  if resume and plan_path.exists():
    tc = dataclasses.replace(tc, steps=json.loads(plan_path.read_text())["steps"])
  elif spec.time_budget_s or deadline:
    tc = dataclasses.replace(tc, steps=_measured_steps(loss_fn, tc, hp, frozen, get_batch, spec.time_budget_s,
                                                       progress, deadline))
  plan_path.write_text(json.dumps({"steps": tc.steps}) + "\n")
  if progress:
    print(f"[train eagle3] {len(ds)} rows, {ds.n_response_tokens} response tokens; draft vocabulary {len(d2t)}; "
          f"head of {_tree_size(hp) / 1e6:.2f}M params; {tc.steps} steps of {bs} x "
          f"{min(spec.loss.max_len or ds.width, ds.width)} tokens, {spec.loss.n_steps} TTT steps ({spec.dtype})",
          flush=True)
  evaluate = None
  if spec.heldout_data and tc.eval_every:    # held-out rows scored while training (over-fitting shows early)
    held = ShardDataset([dc.dir for dc in spec.heldout_data])
    rows = np.arange(min(len(held), EVAL_ROWS))
    evaluate = lambda p: score_rows(loss_fn, p, frozen, held, rows, bs)
  res = train(loss_fn, hp, frozen, get_batch, tc, out, resume=resume, progress=progress, stop_at=stop_at,
              evaluate=evaluate)
  if tc.keep_best and res.best is not None and res.best["params"] is not None and res.step == tc.steps:
    if progress:
      print(f"[train eagle3] exporting the step-{res.best['step']} head (held-out acc_0 "
            f"{res.best['metrics'].get('acc_0')}; the last step's is in the checkpoints)", flush=True)
    res = dataclasses.replace(res, params=jax.tree_util.tree_map(jnp.asarray, res.best["params"]))
  summary = {"name": spec.name, "target": spec.target, "dtype": spec.dtype, "steps": res.step,
             "final_metrics": res.metrics, "seconds_this_run": round(res.seconds, 1),
             "data_seconds": round(data_s, 1), "resumed_from": res.resumed_from,
             "dataset": {"dirs": [dc.dir for dc in dcs], "rows": len(ds), "response_tokens": ds.n_response_tokens,
                         "build_seconds": built},
             "draft_vocab": len(d2t), "head_params": _tree_size(hp), "init_from": start,
             "exported_step": res.best["step"] if tc.keep_best and res.best is not None else res.step,
             "config": dataclasses.asdict(spec),
             "git_revision": git_revision(), "device": device_info(), "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
  if spec.export and res.step == tc.steps:
    w, c = save_head(spec.export, res.params, d2t, hc, extra={"training": summary})
    summary["export"] = {"weights": str(w), "config": str(c), "bytes": w.stat().st_size}
  if spec.heldout_data and res.step == tc.steps:   # after the export: the same metrics on unseen rows and on
    # as many training rows (the head file's JSON does not carry them; summary.json does)
    summary["heldout"] = heldout_scores(lambda d, idx: score_rows(loss_fn, res.params, frozen, d, idx, bs), ds,
                                        [dc.dir for dc in spec.heldout_data], spec.train.seed)
    if progress:
      for k in ("heldout_rows", "training_rows"):
        m = summary["heldout"][k]
        print(f"[train eagle3] {k}: acc {[m[f'acc_{j}'] for j in range(spec.loss.n_steps)]}, "
              f"{m['rows']} rows, in vocabulary {m['in_vocab']}", flush=True)
  (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
  if res.step == tc.steps and res.metrics:
    plot_metrics(out / "metrics.jsonl", out / "training_curve.png",
                 title=f"{spec.name}: EAGLE-3 head for {spec.target}, {res.step} steps")
  return summary
