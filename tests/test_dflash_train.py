"""DFlash training additions: a warm start into a deeper drafter computes what the trained drafter
computes (the extra layers start silent) and refuses a drafter of other taps; held-out scoring
equals the loss function's own metrics on the same rows and anchors; the end-to-end budgeted run
(held-out set built first, training sets while the data budget allows, warm start, scoring); the
side-by-side evaluation's rows (equal to plain decoding, saved row by row)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ToyTokenizer
from specjax.drafters.dflash import DFlashConfig, init_dflash, save_dflash
from specjax.models.load import LoadedModel
from specjax.train.data import DataConfig, ShardDataset, SourceConfig
from specjax.train.dflash import DFlashTrainSpec, DrafterConfig, LossConfig, anchor_blocks, concat_taps, make_loss_fn
from specjax.train.dflash_run import build_budgeted, run_training, score_blocks, warm_start
from specjax.train.loop import TrainConfig
from specjax.models.decoder import forward
from specjax.models.kv_cache import KVCache

DC1 = DFlashConfig(taps=(0, 1), n_layers=1, block_size=4, window=8)
DC2 = dataclasses.replace(DC1, n_layers=2)


def _random_drafter(cfg, dc, seed):
  """A drafter with every parameter random (output projections too: not the silent init)."""
  p = init_dflash(cfg, dc, seed=seed)
  leaves, tree = jax.tree_util.tree_flatten(p)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree_util.tree_unflatten(tree, [0.3 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def test_warm_start_into_a_deeper_drafter_computes_the_same_blocks(tiny_llama, tmp_path):
  cfg, params = tiny_llama
  old = _random_drafter(cfg, DC1, 3)
  save_dflash(tmp_path / "old", old, cfg, DC1, dtype="float32")
  new = warm_start(init_dflash(cfg, DC2, seed=5), tmp_path / "old", cfg, DC2)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 20)), jnp.int32)
  _, tapped, _ = forward(params, cfg, tokens, KVCache.init(cfg, 2, 20), n_new=jnp.full((2,), 20), taps=DC1.taps)
  taps = concat_taps(tapped["layers"])
  anchors = jnp.asarray([[3, 9, 15], [5, 6, 12]], jnp.int32)
  h_old = anchor_blocks(old, params, cfg, DC1, tokens, taps, anchors)               # [R, A, B, D]
  h_new = anchor_blocks(new, params, cfg, DC2, tokens, taps, anchors)
  np.testing.assert_allclose(np.asarray(h_new), np.asarray(h_old), rtol=1e-5, atol=1e-5)
  fresh = anchor_blocks(init_dflash(cfg, DC2, seed=5), params, cfg, DC2, tokens, taps, anchors)
  assert not np.allclose(np.asarray(fresh), np.asarray(h_old), atol=1e-3)        # the copy is what made them equal
  with pytest.raises(ValueError, match="taps"):
    warm_start(init_dflash(cfg, dataclasses.replace(DC2, taps=(0,)), seed=5), tmp_path / "old", cfg,
               dataclasses.replace(DC2, taps=(0,)))


def test_held_out_scoring_equals_the_loss_metrics(tiny_llama):
  """Rows scored in two batches of 3 (the second padded) give the blocks-weighted mean of the loss
  function's metrics on those batches with the same anchor keys."""
  cfg, params = tiny_llama
  rng = np.random.default_rng(1)
  n, width = 5, 24
  lens = rng.integers(10, width + 1, n).astype(np.int32)
  arrays = {"tokens": rng.integers(0, cfg.vocab_size, (n, width)).astype(np.int32), "lens": lens,
            "prompt_lens": np.full(n, 3, np.int32)}

  class Rows:
    def rows(self, idx, with_taps=False):
      return {k: v[idx] for k, v in arrays.items()}

  dp = _random_drafter(cfg, DC1, 7)
  loss_fn = make_loss_fn(cfg, DC1, LossConfig(anchors_per_row=4, batch_size=3), jnp.dtype("float32"))
  got = score_blocks(loss_fn, dp, params, Rows(), np.arange(n), 3)
  parts = []
  for b, idx in enumerate((np.arange(3), np.asarray([3, 4, 3]))):
    batch = {k: jnp.asarray(v[idx]) for k, v in arrays.items()}
    if b == 1:
      batch["lens"] = batch["lens"].at[2].set(1)
    loss, m = loss_fn(dp, params, batch, jax.random.key(b))
    parts.append(({**m, "loss": loss}, float(m["blocks"])))
  w = sum(bl for _, bl in parts)
  assert got["blocks"] == int(w) and got["rows"] == n
  for key in ("tau_est", "loss", "acc_01", "acc_03"):
    want = sum(float(m[key]) * bl for m, bl in parts) / w
    assert abs(got[key] - want) < 1e-4, (key, got[key], want)


def test_budgeted_run_builds_held_out_first_warm_starts_and_scores(tiny_llama, tmp_path):
  """Data budget 0: the held-out set and the first training set are built, the second is not
  started (the first one's time does not fit) and is left out; training warm-starts from a saved
  drafter and the summary scores held-out and training rows."""
  cfg, params = tiny_llama
  target = LoadedModel(name="tiny", cfg=cfg, params=params, tokenizer=ToyTokenizer(), source="tiny-llama")
  prompts = tmp_path / "toy.jsonl"
  prompts.write_text("".join(json.dumps({"question_id": i, "turns": ["abcdefghijkl"[:i + 1]]}) + "\n" for i in range(12)))
  base = dict(sources=(SourceConfig(str(prompts)),), n_sequences=4, max_prompt_len=14, max_new_tokens=8,
              batch_size=4, temperature=0.0, store_taps=False)
  dcs = [DataConfig(dir=str(tmp_path / name), seed=s, **base) for name, s in (("a", 0), ("b", 1), ("held", 2))]
  save_dflash(tmp_path / "init", _random_drafter(cfg, DC1, 3), cfg, DC1, dtype="float32")
  spec = DFlashTrainSpec(name="t", dtype="float32", out_dir=str(tmp_path / "out"), data=dcs[0], extra_data=(dcs[1],),
                         heldout_data=(dcs[2],), data_budget_s=0.0,
                         drafter=DrafterConfig(taps=(0, 1), n_layers=2, block_size=4, window=8,
                                               init_from=str(tmp_path / "init")),
                         loss=LossConfig(anchors_per_row=2, batch_size=2),
                         train=TrainConfig(steps=4, lr=1e-3, warmup_steps=1, log_every=2, ckpt_every=100))
  spec, built = build_budgeted(spec, target, progress=False)
  assert list(built) == [dcs[2].dir, dcs[0].dir, dcs[1].dir] and built[dcs[1].dir] == "skipped"
  assert spec.data == dcs[0] and spec.extra_data == () and len(ShardDataset(dcs[2].dir)) == 4
  summary = run_training(spec, target=target, progress=False)
  assert summary["init_from"] == str(tmp_path / "init") and summary["steps"] == 4
  held = summary["heldout"]
  assert held["heldout_rows"]["rows"] == 4 and held["training_rows"]["rows"] == 4
  assert held["heldout_rows"]["blocks"] > 0 and 1.0 <= held["heldout_rows"]["tau_est"] <= DC1.block_size


def test_eval_rows_equal_plain_decoding_and_are_saved_row_by_row(tiny_llama, tmp_path):
  """`specjax train eval-dflash`'s evaluate on a toy prompt set: per temperature a plain row, then
  one row per method; greedy DFlash rows emit exactly plain decoding's tokens
  (float32: equal_to_plain 1.0) with tau = emitted / rounds in [1, n_max + 1] and acceptance by
  position in [0, 1]; the partial-result callback sees the rows grow one at a time; the timing
  repeats are recorded."""
  from specjax.train.dflash_eval import evaluate
  cfg, params = tiny_llama
  target = LoadedModel(name="tiny", cfg=cfg, params=params, tokenizer=ToyTokenizer(), source="tiny-llama")
  prompts = tmp_path / "toy.jsonl"
  prompts.write_text("".join(json.dumps({"question_id": i, "turns": ["abcdefgh"[:i + 3]]}) + "\n" for i in range(3)))
  head, _ = save_dflash(tmp_path / "d", _random_drafter(cfg, DC1, 5), cfg, DC1, dtype="float32")
  methods = {"dflash n3": ("dflash", str(head), 3, {})}
  seen = []
  res = evaluate(target, methods, prompt_set=str(prompts), n_questions=3, temperatures=(0.0,), max_new_tokens=6,
                 batch_size=2, progress=False, on_row=lambda r: seen.append(len(r["rows"])), repeats=2)
  assert [r["method"] for r in res["rows"]] == ["plain", "dflash n3"] and seen == [1, 2]
  assert res["repeats"] == 2 and res["questions"] == ["0", "1", "2"]
  for row in res["rows"][1:]:
    assert row["equal_to_plain"] == 1.0 and row["tokens"] == res["rows"][0]["tokens"]
    assert 1.0 <= row["tau"] <= row["n_max"] + 1 and all(0.0 <= a <= 1.0 for a in row["acceptance_by_pos"])
