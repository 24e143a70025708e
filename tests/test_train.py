"""Training pipeline: self-distillation shards (resumable, deterministic, read back with taps), the
generic loop (resume from a checkpoint = an uninterrupted run), the MTP config and command, and the
exported head."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ToyTokenizer
from specjax.engine.decode import generate_plain
from specjax.drafters.mtp import load_heads
from specjax.models.load import LoadedModel
from specjax.train.data import DataConfig, ShardDataset, SourceConfig, build_dataset, target_prenorm
from specjax.train.loop import TrainConfig
from specjax.train.mtp import HeadConfig, LossConfig, MTPTrainSpec, load_spec, run_training

STOP = ToyTokenizer.eos_ids[0]


@pytest.fixture(scope="module")
def toy_target(tiny_llama):
  cfg, params = tiny_llama
  return LoadedModel(name="tiny", cfg=cfg, params=params, tokenizer=ToyTokenizer(), source="tiny-llama")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("prompts") / "toy_questions.jsonl"
  rng = np.random.default_rng(0)
  words = ["abc", "de", "fghi", "jk", "lmnop", "q", "rst"]
  lines = []
  for i in range(14):
    text = " ".join(rng.choice(words, size=rng.integers(1, 4)))
    lines.append(json.dumps({"question_id": i, "category": "toy", "turns": [text], "reference": [text[::-1]]}))
  path.write_text("\n".join(lines) + "\n")
  return path


def _data_config(prompt_file, out, **kw) -> DataConfig:
  base = dict(dir=str(out), sources=(SourceConfig(str(prompt_file)),), n_sequences=4, max_prompt_len=14,
              max_new_tokens=10, batch_size=4, temperature=0.0, store_taps=True, taps_dtype="float32", seed=0)
  return DataConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def toy_dataset(toy_target, prompt_file, tmp_path_factory):
  out = tmp_path_factory.mktemp("toy_data")
  build_dataset(toy_target, _data_config(prompt_file, out, n_sequences=8), progress=False)
  return out


def test_data_build_resumes_and_reads_back(toy_target, prompt_file, toy_dataset, tmp_path):
  """Shards hold chat prompt + the target's greedy answer (cut after the stop token) and the
  target's pre-norm hidden states along them. Building 4 rows and then 8 gives the same shards as
  building 8 at once (a bigger dataset extends a smaller one); a shard lost before the manifest
  recorded it is rebuilt identically; other settings in the same folder are refused; MT-bench is
  refused as a source; "reference" mode stores the prompt set's own answers instead of generating;
  several folders read as one dataset; batches are a pure function of the step."""
  cfg, params = toy_target.cfg, toy_target.params
  out = tmp_path / "data"
  build_dataset(toy_target, _data_config(prompt_file, out, n_sequences=4), progress=False)
  assert len(ShardDataset(out)) == 4
  build_dataset(toy_target, _data_config(prompt_file, out, n_sequences=8), progress=False)
  for name in ("shard_00000.npz", "shard_00001.npz", "shard_00001.prenorm.npy"):
    assert (out / name).read_bytes() == (toy_dataset / name).read_bytes(), name
  # a crash after writing shard 1 but before the manifest: rebuilt, identical
  manifest = json.loads((out / "manifest.json").read_text())
  (out / "manifest.json").write_text(json.dumps({"shards": manifest["shards"][:1]}))
  (out / "shard_00001.npz").unlink()
  build_dataset(toy_target, _data_config(prompt_file, out, n_sequences=8), progress=False)
  assert (out / "shard_00001.npz").read_bytes() == (toy_dataset / "shard_00001.npz").read_bytes()
  with pytest.raises(ValueError, match="other settings"):
    build_dataset(toy_target, _data_config(prompt_file, out, max_new_tokens=9), progress=False)
  with pytest.raises(ValueError, match="evaluation set"):
    build_dataset(toy_target, _data_config(prompt_file, tmp_path / "mt", sources=(SourceConfig("mt_bench"),)),
                  progress=False)

  ds = ShardDataset(toy_dataset)
  assert len(ds) == 8 and ds.width == 24
  rows = ds.rows(np.arange(8))
  toks, lens, plens = rows["tokens"], rows["lens"], rows["prompt_lens"]
  prompts = [toks[r, :plens[r]].tolist() for r in range(8)]
  plain = generate_plain(params, cfg, prompts[:4], max_new_tokens=10, stop_ids=(STOP,),
                         capacity=128).tokens
  for r in range(4):
    assert toks[r, plens[r]:lens[r]].tolist() == plain[r]
  assert all(p[0] == 1 and p[-1] == 15 for p in prompts)
  ref = np.asarray(target_prenorm(params, jnp.asarray(toks), jnp.asarray(lens), cfg=cfg))
  for r in range(8):
    np.testing.assert_allclose(rows["prenorm"][r, :lens[r]], ref[r, :lens[r]], atol=1e-5)
  # "reference" answers: the prompt set's own answer + the stop token, no generation; read together
  ref_dir = tmp_path / "ref"
  build_dataset(toy_target, _data_config(prompt_file, ref_dir, responses="reference"), progress=False)
  both = ShardDataset([toy_dataset, ref_dir])
  assert len(both) == 12
  rr = both.rows(np.arange(8, 12))
  texts = [json.loads(ln)["turns"][0] for ln in prompt_file.read_text().splitlines()]
  for r in range(4):
    prompt = rr["tokens"][r, :rr["prompt_lens"][r]].tolist()
    text = next(t for t in texts if ToyTokenizer().encode_chat([{"content": t}]) == prompt)
    assert rr["tokens"][r, rr["prompt_lens"][r]:rr["lens"][r]].tolist() == ToyTokenizer().encode(text[::-1])[:9] + [STOP]
  np.testing.assert_allclose(rr["prenorm"][0, :rr["lens"][0]],
                             np.asarray(target_prenorm(params, jnp.asarray(rr["tokens"]), jnp.asarray(rr["lens"]),
                                                       cfg=cfg))[0, :rr["lens"][0]], atol=1e-5)
  b1, b2 = ds.batch(5, 3, seed=1), ds.batch(5, 3, seed=1)
  assert all(np.array_equal(b1[k], b2[k]) for k in b1)
  seen = np.concatenate([ds.batch(s, 4, seed=1)["tokens"] for s in range(2)])   # one epoch: every row once
  assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, toks.tolist()))


def _spec(toy_dataset, out, **train_kw) -> MTPTrainSpec:
  return MTPTrainSpec(
      name="toy", target="tiny", dtype="float32", out_dir=str(out), export=str(out / "head" / "mtp_head.safetensors"),
      data=DataConfig(dir=str(toy_dataset)), head=HeadConfig(n_heads=2),
      loss=LossConfig(n_steps=3, batch_size=4, positions_per_row=8, loss="kl"),   # = test_mtp's TRAIN_LOSS
      train=TrainConfig(**{**dict(steps=8, lr=1e-2, warmup_steps=2, log_every=2, ckpt_every=3), **train_kw}))


def test_resume_from_checkpoint_equals_uninterrupted_run(toy_target, toy_dataset, tmp_path):
  """8 steps in one go, and 8 steps as: a run killed after step 5 whose last checkpoint is step 3,
  resumed from it. Same parameters bit for bit, same metrics log (the lines logged after the
  checkpoint by the killed run are replaced, not duplicated); the loss went down; the exported head
  is bf16 safetensors + JSON that loads back for the target."""
  full = run_training(_spec(toy_dataset, tmp_path / "a"), target=toy_target, progress=False)
  spec_b = _spec(toy_dataset, tmp_path / "b")
  part = run_training(spec_b, target=toy_target, progress=False, stop_at=5)
  assert part["steps"] == 5 and "export" not in part
  import shutil
  shutil.rmtree(tmp_path / "b" / "checkpoints" / "5")          # the kill came before step 5 was saved
  resumed = run_training(spec_b, target=toy_target, progress=False)
  assert resumed["resumed_from"] == 3 and resumed["steps"] == 8

  ha, _ = load_heads(full["export"]["weights"], toy_target.cfg)
  hb, meta = load_heads(resumed["export"]["weights"], toy_target.cfg)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), ha, hb)
  from specjax.train.loop import Checkpoints
  pa = Checkpoints(tmp_path / "a" / "checkpoints").manager.restore(8)["params"]
  pb = Checkpoints(tmp_path / "b" / "checkpoints").manager.restore(8)["params"]
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), pa, pb)

  log_a = [json.loads(ln) for ln in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
  log_b = [json.loads(ln) for ln in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
  assert [m["step"] for m in log_a] == [m["step"] for m in log_b] == list(range(1, 9))
  assert [m["loss"] for m in log_a] == [m["loss"] for m in log_b]
  assert log_a[-1]["loss"] < log_a[0]["loss"]
  assert meta["n_heads"] == 2 and meta["dtype"] == "bfloat16" and meta["training"]["steps"] == 8
  assert {"loss_0", "acc_0", "loss_2", "grad_norm", "lr"} <= set(log_a[-1])
  # the same curves as TensorBoard event files: every logged loss, read back from the records
  assert _event_scalars(tmp_path / "a" / "tensorboard" / "metrics", "loss") == pytest.approx([m["loss"] for m in log_a])


def _event_scalars(folder, tag: str) -> list[float]:
  """The `tag` scalars of the TensorBoard event files in `folder` (TFRecord framing: u64 length,
  u32 crc, the Event proto, u32 crc)."""
  import struct

  from tensorboardX.proto.event_pb2 import Event
  out = []
  for f in sorted(Path(folder).glob("events.out.tfevents.*")):
    data, pos = f.read_bytes(), 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos:pos + 8])
      event = Event.FromString(data[pos + 12:pos + 12 + n])
      pos += 12 + n + 4
      out += [v.simple_value for v in event.summary.value if v.tag == tag]
  return out


def test_config_and_command(tmp_path):
  """configs/train_mtp_smollm2.yaml loads strictly, flags override it, and `specjax train` is wired into
  the CLI (a missing config is a clean error)."""
  spec = load_spec("configs/train_mtp_smollm2.yaml")
  assert spec.target == "smollm2-135m-instruct" and spec.export.endswith(".safetensors")
  assert all(s.name != "mt_bench" for s in spec.data.sources)
  spec = load_spec("configs/train_mtp_smollm2.yaml", **{"dtype": "bfloat16", "train.steps": 7, "data.dir": "x"})
  assert (spec.dtype, spec.train.steps, spec.data.dir) == ("bfloat16", 7, "x")
  bad = tmp_path / "bad.yaml"
  bad.write_text("name: x\nloss: {n_steps: 2, bogus: 1}\n")
  from specjax.bench.config import ConfigError
  with pytest.raises(ConfigError, match="bogus"):
    load_spec(bad)
  from specjax.cli import main
  assert main(["train", "mtp", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_resume_refuses_checkpoints_of_another_fused_layout(toy_target, toy_dataset, tmp_path):
  """Checkpoints record the parameters' in-memory layout (fused projection order, kernel
  orientation); a folder written without that record (an older order) or with the record of [in,
  out] kernels is refused on resume instead of being loaded with permuted or transposed weights."""
  from specjax.errors import UserError
  spec = _spec(toy_dataset, tmp_path / "c")
  run_training(spec, target=toy_target, progress=False, stop_at=3)
  layout = tmp_path / "c" / "checkpoints" / "fused_layout.txt"
  assert layout.exists()
  layout.write_text("grouped-per-kv-head+gate-up-interleaved\n")              # kernels [in, out]
  with pytest.raises(UserError, match="laid out as 'grouped-per-kv-head\\+gate-up-interleaved'"):
    run_training(spec, target=toy_target, progress=False)
  layout.unlink()
  with pytest.raises(UserError, match="laid out as 'columns side by side'"):
    run_training(spec, target=toy_target, progress=False)
