"""Held-out metrics during training (`train.eval_every`, `train.keep_best`): an EAGLE-3 run on a
tiny target with a held-out dataset logs the held-out metrics at every evaluation step to
heldout.jsonl (and TensorBoard), draws them on the training curve, and with keep_best exports the
head of the best held-out first-step accuracy: the export's own held-out score (summary.json) is
exactly that evaluation's. The generic loop keeps the best evaluation's parameters and trims the
held-out log to the checkpoint on resume."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from conftest import ToyTokenizer
from specjax.models.load import LoadedModel
from specjax.train.data import DataConfig, SourceConfig
from specjax.train.eagle3 import Eagle3HeadConfig, Eagle3LossConfig, Eagle3TrainSpec, run_training
from specjax.train.loop import TrainConfig, train


def test_eagle3_run_logs_held_out_metrics_and_exports_the_best(tiny_llama, tmp_path):
  cfg, params = tiny_llama
  target = LoadedModel(name="tiny", cfg=cfg, params=params, tokenizer=ToyTokenizer(), source="tiny-llama")
  prompts = tmp_path / "toy.jsonl"
  prompts.write_text("".join(json.dumps({"question_id": i, "turns": ["abcdefghijkl"[:i % 12 + 1]]}) + "\n"
                             for i in range(24)))
  base = dict(sources=(SourceConfig(str(prompts)),), max_prompt_len=14, max_new_tokens=10, batch_size=4,
              temperature=0.0, store_taps=False)
  train_dc = DataConfig(dir=str(tmp_path / "train"), seed=0, n_sequences=8, **base)
  held_dc = DataConfig(dir=str(tmp_path / "held"), seed=1, n_sequences=4, **base)
  spec = Eagle3TrainSpec(name="t", dtype="float32", out_dir=str(tmp_path / "out"),
                         export=str(tmp_path / "out" / "export" / "head.safetensors"),
                         data=train_dc, heldout_data=(held_dc,),
                         head=Eagle3HeadConfig(draft_vocab=cfg.vocab_size, init_lm_head="random"),
                         loss=Eagle3LossConfig(n_steps=2, batch_size=4),
                         train=TrainConfig(steps=12, lr=3e-2, warmup_steps=1, log_every=4, ckpt_every=100,
                                           eval_every=3, keep_best=True))
  summary = run_training(spec, target=target, progress=False)
  held = [json.loads(ln) for ln in (tmp_path / "out" / "heldout.jsonl").read_text().split("\n") if ln]
  assert [h["step"] for h in held] == [3, 6, 9, 12] and all(0.0 <= h["acc_0"] <= 1.0 for h in held)
  assert len({h["acc_0"] for h in held}) > 1           # the evaluations differ: picking the best means something
  best = max(held, key=lambda h: h["acc_0"])          # the first of equals, as the loop keeps it
  assert summary["exported_step"] == best["step"]
  exported = summary["heldout"]["heldout_rows"]
  assert abs(exported["acc_0"] - best["acc_0"]) < 1e-4 and abs(exported["loss_0"] - best["loss_0"]) < 1e-3
  assert (tmp_path / "out" / "training_curve.png").stat().st_size > 1000
  assert any(p.name.startswith("events") for p in (tmp_path / "out" / "tensorboard").rglob("*"))


def test_loop_keeps_the_best_evaluation_and_trims_the_log_on_resume(tmp_path):
  """A 1-parameter regression whose `evaluate` reports a score peaking mid-run: `best` holds that
  step's parameters. A run stopped at step 5 (checkpointed there) whose held-out log also has a
  line past it (a run that went on after its last checkpoint) resumes: the lines up to step 5
  stay, the later one goes, the rest is logged once."""
  target_w = 3.0

  def loss_fn(p, frozen, batch, rng):
    loss = jnp.mean((p["w"] * batch["x"] - target_w * batch["x"]) ** 2)
    return loss, {"loss": loss}

  get_batch = lambda step: {"x": np.full((4,), 1.0 + step % 3, np.float32)}
  evaluate = lambda p: {"acc_0": float(-abs(float(p["w"]) - 1.5))}     # best where w passes 1.5
  tc = TrainConfig(steps=10, lr=0.05, warmup_steps=1, log_every=1, ckpt_every=4, eval_every=2, keep_best=True)
  out = tmp_path / "run"
  train(loss_fn, {"w": jnp.float32(0.0)}, {}, get_batch, tc, out, progress=False, stop_at=5, evaluate=evaluate)
  assert [json.loads(ln)["step"] for ln in (out / "heldout.jsonl").read_text().split("\n") if ln] == [2, 4, 5]
  with open(out / "heldout.jsonl", "a") as f:
    f.write(json.dumps({"step": 7, "acc_0": 1.0}) + "\n")
  res = train(loss_fn, {"w": jnp.float32(0.0)}, {}, get_batch, tc, out, progress=False, evaluate=evaluate)
  held = [json.loads(ln) for ln in (out / "heldout.jsonl").read_text().split("\n") if ln]
  assert [h["step"] for h in held] == [2, 4, 5, 6, 8, 10] and held[3]["acc_0"] != 1.0
  after = [h for h in held if h["step"] > 5]
  best = max(after, key=lambda h: h["acc_0"])
  assert res.best["step"] == best["step"] and abs(-abs(float(res.best["params"]["w"]) - 1.5) - best["acc_0"]) < 1e-6
