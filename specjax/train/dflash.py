"""Training a DFlash drafter on self-distillation data, target frozen.

Per row, the frozen target runs once inside the loss (cheap for a small target on an accelerator;
the data need not store taps) and gives the outputs of the tapped layers, fused by the drafter's
`fc` + RMSNorm into context features. Then `anchors_per_row` random anchor positions a in the
response each start a block `[x_a, MASK x (B-1)]` at positions a .. a+B-1; all blocks of a row go
through the drafter in one pass with a block-diagonal mask: block a sees the context features of
positions [a - window, a) (what the drafter's feature window holds when `last` = x_a sits at a)
and its own block, non-causally. Block slot k predicts x_{a+k}; its loss weighs
`exp(-(k-1) / gamma)`, against the data token (`loss: ce`) or the target's distribution there
(`loss: kl`, soft cross-entropy). Metrics: loss, top-1 accuracy per block slot, and `tau_est`,
the tokens per round a greedy verification of these blocks would give (1 + accepted prefix),
averaged over uniformly drawn anchors: it overstates the engine's tau on the same rows, whose rounds
skip the anchors inside accepted runs (SmolLM2, GSM8K answers: 2.30 vs 2.05 replayed as rounds,
experiments/dflash_gap.py), and it is measured on training rows.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.drafters.dflash import DFlashConfig, block_inputs, concat_taps, model_of, spread_taps
from specjax.models.config import ModelConfig
from specjax.models.decoder import forward, lm_head_logits, logits_from_prenorm
from specjax.models.kv_cache import KVCache
from specjax.train.data import DataConfig
from specjax.train.loop import TrainConfig
from specjax.train.shards import batch_loss_mask


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
  n_taps: int = 5                    # target layers spread from 1 to N-3 (ignored when `taps` is given)
  taps: tuple[int, ...] | None = None
  n_layers: int = 2
  block_size: int = 16
  window: int = 256
  ffn_dim: int | None = None         # MLP width of the drafter's layers (default: the target's)
  init_from: str | None = None       # start from this trained drafter (same taps, block, widths; it may have
                                     # fewer layers: the extra ones start silent); skipped with a note if missing
  mask_token_id: int | None = None   # MASK = the target's embedding of this token (z-lab) instead of a learned one
  reference_layout: bool = False     # z-lab's drafter: Qwen3 layers (QK-norm) and its own final norm, so that
                                     # `specjax export-head` can write it (with mask_token_id)

  def resolve(self, cfg: ModelConfig) -> DFlashConfig:
    taps = tuple(self.taps) if self.taps else spread_taps(cfg.n_layers, self.n_taps)
    from specjax.drafters.dflash_reference import REFERENCE_LAYER
    ref = dict(final_norm=True, layer_fields=tuple(REFERENCE_LAYER.items())) if self.reference_layout else {}
    return DFlashConfig(taps=taps, n_layers=self.n_layers, block_size=self.block_size, window=self.window,
                        ffn_dim=self.ffn_dim, mask_token_id=self.mask_token_id, **ref)


@dataclasses.dataclass(frozen=True)
class LossConfig:
  anchors_per_row: int = 16          # blocks per row per step
  gamma: float = 7.0                 # block slot k weighs exp(-(k-1) / gamma)
  loss: str = "kl"                   # kl: soft cross-entropy to the target's distribution; ce: data tokens
  batch_size: int = 16               # rows per step
  max_len: int | None = None         # random windows of this many tokens (None: whole rows)


@dataclasses.dataclass(frozen=True)
class HeldOut:
  """The first `first` prompts of prompt set `name`: rows answering them are left out of training
  (evaluation prompts that a shared dataset holds, e.g. HumanEval 1-16)."""
  name: str
  first: int


@dataclasses.dataclass(frozen=True)
class DFlashTrainSpec:
  name: str
  target: str = "smollm2-135m-instruct"
  dtype: str = "float32"             # the target's (and the compute) dtype: bfloat16 on GPU
  out_dir: str = "out/dflash"
  export: str | None = None          # where the trained drafter goes (safetensors + json)
  data: DataConfig = DataConfig()
  extra_data: tuple[DataConfig, ...] = ()
  drafter: DrafterConfig = DrafterConfig()
  loss: LossConfig = LossConfig()
  train: TrainConfig = TrainConfig()
  train_seconds: float | None = None  # stop (and decay the schedule) to fit this much training time
  wall_budget_s: float | None = None  # the whole run (load, data, compilation, training, export, scoring) in
                                      # about this long: training gets what is left (END_RESERVE_S kept)
  data_budget_s: float | None = None  # datasets still to generate are built in order while the next one is
                                      # predicted to fit (specjax.train.data.build_within); the rest are left out
  held_out: tuple[HeldOut, ...] = ()  # evaluation prompts whose rows are dropped from the datasets
  heldout_data: tuple[DataConfig, ...] = ()   # built first, never trained on: the drafter is scored on them
                                      # and on as many training rows (summary.json "heldout")


def load_spec(path: str | Path, **overrides) -> DFlashTrainSpec:
  from specjax.bench.config import ConfigError
  from specjax.train.spec import load_train_spec
  path = Path(path)
  spec = load_train_spec(DFlashTrainSpec, path, overrides)
  if spec.loss.loss not in ("kl", "ce"):
    raise ConfigError(f"{path.name}: loss.loss must be 'kl' or 'ce', got {spec.loss.loss!r}")
  trained = {dc.dir for dc in (spec.data,) + spec.extra_data}
  if any(dc.dir in trained for dc in spec.heldout_data):
    raise ConfigError(f"{path.name}: a heldout_data dir is also trained on")
  return spec


# ----------------------------------------------------------------------------------------------
# the loss


def anchor_blocks(dparams, tparams, cfg: ModelConfig, dc: DFlashConfig, tokens, layer_taps, anchors):
  """The drafter's hidden states of the blocks at `anchors` [R, A], all in one pass: [R, A, B, D].
  tokens [R, L]; layer_taps [R, L, n_taps * D] the target's taps along the rows. Block a sees the
  context positions [a - window, a) and its own block."""
  r, length = tokens.shape
  a_n, bk = anchors.shape[1], dc.block_size
  model = model_of(dparams, cfg, dc)
  ctx = model.fuse(layer_taps)                                                     # [R, L, D]
  x = block_inputs(dparams, tparams, cfg, dc, jnp.take_along_axis(tokens, anchors, axis=1))   # [R, A, B, D]
  x = x.reshape(r, a_n * bk, cfg.d_model)
  positions = (anchors[:, :, None] + jnp.arange(bk)[None, None, :]).reshape(r, a_n * bk)      # [R, A*B]
  p = jnp.arange(length, dtype=jnp.int32)
  ctx_vis = (p[None, None, :] < anchors[:, :, None]) & (p[None, None, :] >= anchors[:, :, None] - dc.window)
  ctx_vis = jnp.repeat(ctx_vis, bk, axis=1)                                        # [R, A*B, L]
  blk = jnp.arange(a_n * bk) // bk
  blk_vis = jnp.broadcast_to((blk[:, None] == blk[None, :])[None], (r, a_n * bk, a_n * bk))
  mask = jnp.concatenate([ctx_vis, blk_vis], axis=2)                               # [R, A*B, L + A*B]
  ctx_pos = jnp.broadcast_to(p[None, :], (r, length))
  h = model(x, positions, ctx, ctx_pos, mask)                                      # [R, A*B, D]
  return h.reshape(r, a_n, bk, cfg.d_model)


def sample_anchors(rng, loss_mask, n: int):
  """n distinct anchor positions per row among the a >= 1 where tokens a and a + 1 are both learned
  (loss_mask [R, L]: an anchor is an answer token with at least one answer token after it; in a
  prompt + response row, a in [max(prompt_len, 1), len - 2]). -> (anchors [R, n], valid [R, n])."""
  length = loss_mask.shape[1]
  p = jnp.arange(length)[None, :]
  ok = loss_mask & jnp.pad(loss_mask[:, 1:], ((0, 0), (0, 1))) & (p >= 1)          # [R, L]
  score = jnp.where(ok, jax.random.uniform(rng, ok.shape), -1.0)
  top, idx = jax.lax.top_k(score, min(n, length))
  return idx.astype(jnp.int32), top >= 0


def _cast(tree, dtype):
  return jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


@functools.lru_cache(maxsize=16)
def make_loss_fn(cfg: ModelConfig, dc: DFlashConfig, lc: LossConfig, compute_dtype):
  """loss_fn(dparams, target_params, batch, rng) -> (loss, metrics) for `specjax.train.loop.train`.
  batch: tokens [R, L], lens [R], loss_mask [R, L] (else prompt_lens [R]: the response is learned).
  Cached, so the loop's jitted step is reused."""
  bk = dc.block_size
  weights = jnp.exp(-jnp.arange(bk - 1, dtype=jnp.float32) / lc.gamma)            # slot k = 1 .. B-1

  @jax.checkpoint   # keep no [R, A, B-1, V] logits alive for the backward pass
  def slot_nll(tparams, h, target_h, labels):
    draft = lm_head_logits if dc.final_norm else logits_from_prenorm     # final_norm: h is normed already
    logp = jax.nn.log_softmax(draft(tparams, cfg, h[None])[0], axis=-1)             # [N, V]
    if target_h is not None:
      tlogits = jax.lax.stop_gradient(logits_from_prenorm(tparams, cfg, target_h[None])[0])
      tlogp = jax.nn.log_softmax(tlogits, axis=-1)
      nll = -jnp.sum(jnp.exp(tlogp) * logp, axis=-1)
      labels = jnp.argmax(tlogp, axis=-1)
    else:
      nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return nll, jnp.argmax(logp, axis=-1) == labels

  def loss_fn(dparams, tparams, batch, rng):
    tokens, lens, learned = batch["tokens"], batch["lens"], batch_loss_mask(batch)
    r, length = tokens.shape
    cache = KVCache.init(cfg, r, length, dtype=jax.tree_util.tree_leaves(tparams)[0].dtype)
    _, tapped, _ = forward(tparams, cfg, tokens, cache, n_new=lens, taps=dc.taps)
    layer_taps = jax.lax.stop_gradient(concat_taps(tapped["layers"]))             # [R, L, n_taps * D]
    prenorm = jax.lax.stop_gradient(tapped["prenorm"])
    anchors, a_ok = sample_anchors(rng, learned, lc.anchors_per_row)              # [R, A]
    h = anchor_blocks(_cast(dparams, compute_dtype), tparams, cfg, dc, tokens, layer_taps, anchors)
    tgt = anchors[:, :, None] + jnp.arange(1, bk)[None, None, :]                  # [R, A, B-1] predicted positions
    tgt_c = jnp.minimum(tgt, length - 1)
    valid = a_ok[:, :, None] & (tgt < lens[:, None, None]) & jnp.take_along_axis(
        learned, tgt_c.reshape(r, -1), axis=1).reshape(tgt.shape)                  # learned targets only
    flat = lambda x: x.reshape((-1,) + x.shape[3:])
    labels = flat(jnp.take_along_axis(tokens, tgt_c.reshape(r, -1), axis=1).reshape(tgt.shape))
    target_h = None
    if lc.loss == "kl":   # the target's distribution for x_{a+k}: its logits at position a+k-1
      target_h = flat(jnp.take_along_axis(prenorm, (tgt_c - 1).reshape(r, -1, 1), axis=1).reshape(tgt.shape + (-1,)))
    h = flat(h[:, :, 1:])                                                         # [N, D]
    if dc.final_norm:
      h = model_of(_cast(dparams, compute_dtype), cfg, dc).norm(h)
    nll, hit = slot_nll(tparams, h, target_h, labels)
    nll, hit = nll.reshape(tgt.shape), hit.reshape(tgt.shape) & valid                # [R, A, B-1]
    w = weights[None, None, :] * valid
    loss = jnp.sum(w * nll) / jnp.maximum(jnp.sum(w), 1e-6)
    n_slot = jnp.maximum(jnp.sum(valid, axis=(0, 1)), 1)
    metrics = {f"acc_{k + 1:02d}": jnp.sum(hit[..., k]) / n_slot[k] for k in range(bk - 1)}
    accepted = jnp.sum(jnp.cumprod(hit.astype(jnp.int32), axis=-1), axis=-1)        # [R, A]
    metrics["tau_est"] = jnp.sum(jnp.where(a_ok, 1 + accepted, 0)) / jnp.maximum(jnp.sum(a_ok), 1)
    metrics["blocks"] = jnp.sum(a_ok).astype(jnp.float32)
    return loss, metrics

  return loss_fn
