"""Training MTP heads on self-distillation data, target frozen.

The loss unrolls the drafter exactly as `specjax/drafters/mtp.py` drafts: for every base position
i of a row at once,
  step 0: head 0 over the committed entries (h_i, x_{i+1}), causal            -> predicts x_{i+2}
  step j: head m(j) on (h'^{j-1}_i, x_{i+j+1}) at position i + j              -> predicts x_{i+j+2}
where a step-j entry sees head m(j)'s committed entries at positions <= i and its own earlier
step entries at the same base i (the diagonal), the KV layout the drafter's cache has while
drafting. Teacher forcing: the step inputs are the data tokens, which is what the drafter sees
whenever its earlier drafts were accepted (the only case where the later ones matter).

Per step the loss is the cross-entropy of the head's distribution against either the target's
distribution at that position (`loss: kl`, soft labels) or the data token (`loss: ce`), over
response tokens (or every token, `train_on_prompt`), weighted `step_weight ** j`.
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

from specjax.drafters.mtp import apply_head, head_for_step, init_heads, save_heads
from specjax.models.config import ModelConfig
from specjax.models.decoder import embed_tokens, forward, logits_from_prenorm
from specjax.models.kv_cache import KVCache
from specjax.train.data import DataConfig
from specjax.train.loop import TrainConfig
from specjax.train.shards import batch_loss_mask


@dataclasses.dataclass(frozen=True)
class HeadConfig:
  n_heads: int = 1                   # distinct heads; drafting step j uses head min(j, n_heads - 1)
  init: str = "identity"             # "identity": starts as the identity on h (see init_heads); "random"
  block_from_layer: int | None = None   # start each head's block as a copy of this target layer


@dataclasses.dataclass(frozen=True)
class LossConfig:
  n_steps: int = 3                   # drafting steps unrolled in training (>= n_heads)
  step_weight: float = 0.8           # step j weighs step_weight ** j
  loss: str = "kl"                   # kl: soft cross-entropy to the target's distribution; ce: data tokens
  train_on_prompt: bool = False      # also predict prompt tokens
  batch_size: int = 8
  max_len: int | None = None         # train on random windows of this many tokens of each row
  positions_per_row: int | None = None   # LM head (and loss) at this many random positions per row
  recompute_taps: bool = False       # run the frozen target in the step even if the data has taps


@dataclasses.dataclass(frozen=True)
class MTPTrainSpec:
  """One YAML file: where the data comes from, the head, the loss and the optimizer."""
  name: str
  target: str = "smollm2-135m-instruct"
  dtype: str = "float32"             # the target's (and the compute) dtype: bfloat16 on GPU
  out_dir: str = "out/mtp"           # checkpoints, metrics.jsonl
  export: str | None = None          # where the trained head goes (safetensors + json)
  data: DataConfig = DataConfig()
  extra_data: tuple[DataConfig, ...] = ()   # more datasets (e.g. responses: reference), trained on together
  head: HeadConfig = HeadConfig()
  loss: LossConfig = LossConfig()
  train: TrainConfig = TrainConfig()


def load_spec(path: str | Path, **overrides) -> MTPTrainSpec:
  from specjax.bench.config import ConfigError
  from specjax.train.spec import load_train_spec
  path = Path(path)
  spec = load_train_spec(MTPTrainSpec, path, overrides)
  if spec.loss.n_steps < spec.head.n_heads:
    raise ConfigError(f"{path.name}: loss.n_steps ({spec.loss.n_steps}) must be >= head.n_heads ({spec.head.n_heads})")
  if spec.loss.loss not in ("kl", "ce"):
    raise ConfigError(f"{path.name}: loss.loss must be 'kl' or 'ce', got {spec.loss.loss!r}")
  return spec


# ----------------------------------------------------------------------------------------------
# the unrolled heads


def _shift_left(x, s: int):
  """x[:, i] <- x[:, i + s] along axis 1 (zeros past the end)."""
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, s)
  return jnp.pad(x[:, s:], pad)


def _shift_right(x, s: int):
  pad = [(0, 0)] * x.ndim
  pad[1] = (s, 0)
  return jnp.pad(x[:, :x.shape[1] - s], pad)


def unrolled_outputs(heads, cfg: ModelConfig, tparams, tokens, prenorm, n_steps: int) -> list[jax.Array]:
  """Head outputs o^j [B, L, D] for steps j < n_steps at every base position i (see module doc).
  tokens [B, L]; prenorm [B, L, D] the target's hidden states along them."""
  b, length = tokens.shape
  n_heads = len(heads)
  pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None, :], (b, length))
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool))[None], (b, length, length))
  eye = jnp.broadcast_to(jnp.eye(length, dtype=bool)[None], (b, length, length))
  emb1 = embed_tokens(tparams, cfg, _shift_left(tokens, 1))                      # x_{i+1}
  committed = {}
  for m in sorted({head_for_step(j, n_heads) for j in range(n_steps)}):
    out, kv = apply_head(heads[m], cfg, emb1, prenorm, pos, lambda k, v: (k, v),
                         {"full": causal, "sliding": causal})
    committed[m] = (out, kv)
  outs = [committed[0][0]]
  diag: dict[int, list] = {m: [] for m in committed}
  for j in range(1, n_steps):
    m = head_for_step(j, n_heads)
    (kc, vc) = committed[m][1]
    prev_k = [kc] + [k for k, _ in diag[m]]
    prev_v = [vc] + [v for _, v in diag[m]]
    write = lambda k, v, pk=prev_k, pv=prev_v: (jnp.concatenate(pk + [k], axis=1), jnp.concatenate(pv + [v], axis=1))
    mask = jnp.concatenate([causal] + [eye] * (len(diag[m]) + 1), axis=2)        # [B, L, L * (n + 1)]
    emb = embed_tokens(tparams, cfg, _shift_left(tokens, j + 1))                 # x_{i+j+1}
    out, (k_all, v_all) = apply_head(heads[m], cfg, emb, outs[-1], pos + j, write, {"full": mask, "sliding": mask})
    diag[m].append((k_all[:, -length:], v_all[:, -length:]))
    outs.append(out)
  return outs


def _cast(tree, dtype):
  return jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


@functools.lru_cache(maxsize=16)
def make_loss_fn(cfg: ModelConfig, lc: LossConfig, n_heads: int, compute_dtype):
  """loss_fn(heads, target_params, batch, rng) -> (loss, metrics) for `specjax.train.loop.train`.
  batch: tokens [B, L], lens [B], loss_mask [B, L] (else prompt_lens [B]: the response is learned),
  and prenorm [B, L, D] unless it is recomputed.
  Cached: the same arguments give the same function, so the loop's jitted step is reused."""

  def step_loss(tparams, o, target_logp, labels, valid):
    logits = logits_from_prenorm(tparams, cfg, o)                                  # [B, L, V] f32
    logp = jax.nn.log_softmax(logits, axis=-1)
    if target_logp is not None:
      nll = -jnp.sum(jnp.exp(target_logp) * logp, axis=-1)                        # soft cross-entropy
    else:
      nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    hit = (jnp.argmax(logits, axis=-1) == labels) & valid
    n = jnp.maximum(jnp.sum(valid), 1)
    return jnp.sum(jnp.where(valid, nll, 0.0)) / n, jnp.sum(hit) / n

  if not lc.positions_per_row:
    step_loss = jax.checkpoint(step_loss)   # keep no [B, L, V] logits alive for the backward pass

  def loss_fn(heads, tparams, batch, rng):
    tokens, lens = batch["tokens"], batch["lens"]
    b, length = tokens.shape
    if "prenorm" in batch and not lc.recompute_taps:
      prenorm = batch["prenorm"].astype(jnp.float32)          # the residual stream is float32
    else:
      cache = KVCache.init(cfg, b, length, dtype=jax.tree_util.tree_leaves(tparams)[0].dtype)
      prenorm = forward(tparams, cfg, tokens, cache, n_new=lens)[1]["prenorm"]
    prenorm = jax.lax.stop_gradient(prenorm)
    heads_c = _cast(heads, compute_dtype)
    outs = unrolled_outputs(heads_c, cfg, tparams, tokens, prenorm, lc.n_steps)
    # Align step j's output at base i with position p = i + j + 1, whose next token x_{p+1} it predicts.
    p = jnp.broadcast_to(jnp.arange(length)[None, :], (b, length))
    in_row = p + 1 < lens[:, None]
    wanted = in_row & (_shift_left(batch_loss_mask(batch), 1) | lc.train_on_prompt)   # x_{p+1} is learned
    if lc.positions_per_row:   # the LM head only at a random sample of positions (it dominates the cost)
      score = jnp.where(wanted, jax.random.uniform(rng, (b, length)), -1.0)
      _, idx = jax.lax.top_k(score, min(lc.positions_per_row, length))              # [B, P]
      sel = lambda x: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
    else:
      sel = lambda x: x
    target_logp, labels = None, sel(_shift_left(tokens, 1))                         # x_{p+1}
    if lc.loss == "kl":
      tlogits = jax.lax.stop_gradient(logits_from_prenorm(tparams, cfg, sel(prenorm)))   # [B, P, V]
      target_logp = jax.nn.log_softmax(tlogits, axis=-1)
      labels = jnp.argmax(tlogits, axis=-1)
    total, wsum, metrics = 0.0, 0.0, {}
    for j, o in enumerate(outs):
      valid = sel(wanted & (p >= j + 1))
      l_j, acc_j = step_loss(tparams, sel(_shift_right(o, j + 1)), target_logp, labels, valid)
      w = lc.step_weight ** j
      total, wsum = total + w * l_j, wsum + w
      metrics[f"loss_{j}"], metrics[f"acc_{j}"] = l_j, acc_j
    metrics["tokens"] = jnp.sum(wanted).astype(jnp.float32)
    return total / wsum, metrics

  return loss_fn


# ----------------------------------------------------------------------------------------------
# the command


def _tree_size(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


def run_training(spec: MTPTrainSpec, *, resume: bool = True, progress: bool = True, target=None,
                 stop_at: int | None = None) -> dict:
  """Train the head of `spec` on its dataset; export it; return a summary (also written as
  `out_dir/summary.json`)."""
  from specjax.bench.env import device_info, git_revision
  from specjax.models.load import load_model, require_unpadded
  from specjax.train.data import ShardDataset
  from specjax.train.loop import train

  dtype = jnp.dtype(spec.dtype)
  target = target or load_model(spec.target, dtype=dtype, progress=progress)
  require_unpadded(target, "MTP head training")
  cfg = target.cfg
  dirs = [spec.data.dir] + [e.dir for e in spec.extra_data]
  ds = ShardDataset(dirs)
  for d, info in zip(dirs, ds.infos):
    if info["identity"]["d_model"] != cfg.d_model:
      raise ValueError(f"dataset {d} was built for d_model {info['identity']['d_model']}, target has {cfg.d_model}")
  use_taps = ds.has_taps and not spec.loss.recompute_taps
  heads = init_heads(cfg, spec.head.n_heads, seed=spec.train.seed, dtype=jnp.float32, init=spec.head.init,
                     target_params=target.params, block_from_layer=spec.head.block_from_layer)
  loss_fn = make_loss_fn(cfg, spec.loss, spec.head.n_heads, jnp.dtype(spec.dtype))
  bs = spec.loss.batch_size
  get_batch = lambda step: ds.batch(step, bs, seed=spec.train.seed, with_taps=use_taps, max_len=spec.loss.max_len)
  if progress:
    print(f"[train mtp] {len(ds)} rows, {ds.n_response_tokens} response tokens, taps "
          f"{'stored' if use_taps else 'recomputed'}; {spec.head.n_heads} head(s) of {_tree_size(heads) / 1e6:.2f}M "
          f"params; {spec.train.steps} steps of {bs} x {min(spec.loss.max_len or ds.width, ds.width)} tokens "
          f"({spec.dtype})", flush=True)
  res = train(loss_fn, heads, target.params, get_batch, spec.train, spec.out_dir, resume=resume,
              progress=progress, stop_at=stop_at)
  summary = {"name": spec.name, "target": spec.target, "dtype": spec.dtype, "steps": res.step,
             "final_metrics": res.metrics, "seconds_this_run": round(res.seconds, 1),
             "resumed_from": res.resumed_from, "dataset": {"dirs": dirs, "rows": len(ds),
             "response_tokens": ds.n_response_tokens}, "config": dataclasses.asdict(spec),
             "git_revision": git_revision(), "device": device_info(),
             "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
  if spec.export and res.step == spec.train.steps:
    w, c = save_heads(spec.export, res.params, cfg, extra={"training": summary})
    summary["export"] = {"weights": str(w), "config": str(c), "bytes": w.stat().st_size}
  Path(spec.out_dir).mkdir(parents=True, exist_ok=True)
  (Path(spec.out_dir) / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
  if res.step == spec.train.steps and res.metrics:
    from specjax.train.loop import plot_metrics
    plot_metrics(Path(spec.out_dir) / "metrics.jsonl", Path(spec.out_dir) / "training_curve.png",
                 title=f"{spec.name}: {spec.target}, {res.step} steps")
  return summary


# ----------------------------------------------------------------------------------------------
# a quick acceptance check of a trained head


def evaluate_head(target, head, *, prompt_set: str = "mt_bench", per_category: int = 1, n_max=(1, 2, 3, 4),
                  max_new_tokens: int = 128, temperature: float = 0.0, batch_size: int | None = None,
                  seed: int = 0, progress: bool = True) -> dict:
  """tau (tokens per verification round, also by category) and acceptance by draft position of a
  head (a file, or heads in memory) on the first turns of `per_category` questions of each category
  of `prompt_set`, for each n_max; plus tokens/s against plain decoding of the same batches and
  whether the outputs equal plain decoding's (greedy). Measured by the bench harness
  (`specjax.train.head_eval`)."""
  from specjax.bench.env import device_info, git_revision
  from specjax.bench.prompts import load_prompt_set
  from specjax.train.head_eval import evaluate_rows, head_method

  questions, per = [], {}
  for q in load_prompt_set(prompt_set):
    if per.get(q.category, 0) < per_category:
      per[q.category] = per.get(q.category, 0) + 1
      questions.append(q)
  b = batch_size or len(questions)
  methods = [head_method(target, f"mtp n{nm}", "mtp", head, nm) for nm in n_max]
  rows = evaluate_rows(target, questions, methods, temperatures=(temperature,), max_new_tokens=max_new_tokens,
                       batch_size=b, seed=seed, progress=progress, tag="eval mtp")
  keys = ("n_max", "tau", "rounds", "tokens", "acceptance_by_pos", "tokens_per_s", "speedup", "equal_to_plain",
          "tau_by_category")
  return {"prompt_set": prompt_set, "questions": [q.question_id for q in questions],
          "categories": [q.category for q in questions], "max_new_tokens": max_new_tokens,
          "temperature": temperature, "batch_size": b, "plain_tokens_per_s": rows[0]["tokens_per_s"],
          "results": [{k: r.get(k) for k in keys} for r in rows[1:]],
          "head": str(head) if isinstance(head, (str, Path)) else "(in memory)",
          "git_revision": git_revision(), "device": device_info()}
