"""The work of tests/test_sharding.py, run in a subprocess with 8 simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before jax starts, and the rest of
the suite keeps one device). Prints one JSON line per check; the test asserts on them.

    python tests/sharding_worker.py greedy BATCH MESH[;MESH...] [NAME,...]
        greedy tokens of plain decoding and every registered speculator on the one-device target
        and on each mesh -> {"kind": "greedy", "mesh", "batch", "name", "ok", "ref", "got"}
    python tests/sharding_worker.py law MESH
        sampled speculation on a sharded target: p-values of the token-law check
    python tests/sharding_worker.py train MESH TMPDIR
        one head-training step on the mesh and on one device: max |difference| of params and loss
    python tests/sharding_worker.py dist MESH       (under SPECJAX_COORDINATOR_ADDRESS & co.)
        greedy tokens of one multi-process run (process 0 prints them)
    python tests/sharding_worker.py padded MESH:NAME[,NAME...][;MESH:NAME...] TMPDIR
        a target of 6 heads / 3 KV heads, which model=2 and 4 do not divide (`api.shard` pads them
        with zero KV groups): greedy tokens of each (mesh, speculator) against the one-device plain
        output -> {"kind": "padded", "mesh", "name", "ok", "ref", "got", "cfg", "logical"}
    python tests/sharding_worker.py real GGUF MESH
        the real SmolLM2-135M (9 heads, 3 KV heads) in float32: greedy tokens of a chat prompt on
        one device and on the mesh (padded to 4 KV heads on model=2) -> {"kind": "real", ...}

The target is tests/conftest.py's tiny llama with 8 heads and 4 KV heads (V=16, 2 layers); heads and the
draft model are tiny and random, as in the drafters' own losslessness tests.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("SPECJAX_COMPILE_CACHE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from conftest import TINY_LLAMA, perturb, random_params  # noqa: E402
from specjax import api, parallel  # noqa: E402
from specjax.drafters import speculator_spec  # noqa: E402
from specjax.models.load import LoadedModel  # noqa: E402

PROMPTS = [[1, 5, 9, 3, 5, 9, 3, 5], [2, 4, 6], [7, 7, 7, 7, 1, 2, 7, 7, 7]]
MAX_NEW = 8
N_MAX = 3                                   # chain drafts; trees get TREE_NODES nodes
TREE_NODES = 6
TREE = {"depth": 2, "top_k": 2}


# the tiny llama with 8 query / 4 KV heads of 4 dimensions (same d_model): model=4 divides them
TINY_SHARDABLE = TINY_LLAMA.replace(n_heads=8, n_kv_heads=4, head_dim=4)
# 6 query / 3 KV heads: model=2 and 4 do not divide them (`api.shard` pads them to 4 KV heads)
TINY_PADDED = TINY_LLAMA.replace(n_heads=6, n_kv_heads=3, head_dim=4)


def tiny_target() -> LoadedModel:
  return LoadedModel(name="tiny", cfg=TINY_SHARDABLE, params=random_params(TINY_SHARDABLE, seed=0))


def build_drafter(name: str, target: LoadedModel, head_dir: str | None = None):
  """A drafter of the registered speculator `name` for `target`, with tiny random heads (or a
  perturbed copy of the target as draft model) where it needs them. None = plain decoding. Heads
  are made for the target's own config (`logical_cfg`: a padded target's unpadded one); with
  `head_dir` an MTP head goes through a head file, checked against it when it loads."""
  if name == "plain":
    return None, None
  spec = speculator_spec.get(name)
  dp = {"n_max": TREE_NODES if spec.tree else N_MAX}
  from specjax.drafters.base import DraftParams
  kw: dict = {}
  if spec.needs_draft_model:
    kw["draft_model"] = LoadedModel(name="draft", cfg=target.cfg, params=perturb(target.params, 0.3, seed=2))
  if spec.tree and "depth" in spec.option_names:
    kw.update(TREE)
  if spec.head_format == "specjax-mtp-v1":
    from specjax.drafters.mtp import init_heads, save_heads
    kw["head"] = init_heads(target.logical_cfg, 2, seed=1)
    if head_dir is not None:
      kw["head"] = str(save_heads(f"{head_dir}/mtp_head", kw["head"], target.logical_cfg, dtype="float32")[0])
  elif spec.head_format == "specjax-eagle3-v1":
    from specjax.drafters.eagle3 import Eagle3Config, build_d2t, init_head
    hc = Eagle3Config.make(target.logical_cfg, 12)
    d2t = build_d2t([np.repeat(np.arange(16), np.arange(16, 0, -1))], target.cfg.vocab_size, 12)
    kw.update(head=init_head(hc, 7, target_params=target.params, d2t=d2t), hc=hc, d2t=d2t)
  elif spec.head_format == "specjax-dflash-v1":
    from specjax.drafters.dflash import DFlashConfig, init_dflash
    dc = DFlashConfig(taps=(0, 1), n_layers=1, block_size=4, window=8)
    kw["head"] = (init_dflash(target.logical_cfg, dc, seed=3, target_params=target.params), dc)
  elif spec.head_format:
    raise SystemExit(f"no tiny head for head format {spec.head_format!r} ({name})")
  return spec.build(target, draft_params=DraftParams(**dp), **kw), dp


def run(target, name, prompts, head_dir=None, **kw):
  drafter, dp = build_drafter(name, target, head_dir)
  if drafter is None:
    return api.generate(target, prompts, chat=False, max_new_tokens=MAX_NEW, **kw).tokens
  return api.generate(target, prompts, speculator=drafter, draft_params=dp, chat=False, max_new_tokens=MAX_NEW,
                      **kw).tokens


def greedy(batch: int, meshes: list[str], names: list[str]) -> None:
  """Each speculator's greedy output on each mesh against the one-device plain greedy output (every
  registered speculator is lossless on one device: tests/test_registry_laws.py), computed once."""
  target = tiny_target()
  prompts = PROMPTS[:batch]
  ref = run(target, "plain", prompts)
  for name in names:
    t0 = time.perf_counter()
    for spec in meshes:
      got = run(api.shard(target, spec), name, prompts)
      print(json.dumps({"kind": "greedy", "mesh": spec, "batch": batch, "name": name, "ok": got == ref,
                        "ref": ref, "got": got, "s": round(time.perf_counter() - t0, 2)}), flush=True)


def heads(batch: int, meshes: list[str], names: list[str]) -> None:
  """Greedy output of head speculators on targets sharded with their heads split over "model"
  (`head_placement="sharded"`) against the one-device plain output; per row, how many of the
  head's leaves are split and whether its KV cache is (`kv_on_model`)."""
  from specjax import parallel
  target = tiny_target()
  prompts = PROMPTS[:batch]
  ref = run(target, "plain", prompts)
  for spec in meshes:
    sharded = api.shard(target, spec, head_placement="sharded")
    for name in names:
      got = run(sharded, name, prompts)
      drafter, _ = build_drafter(name, sharded)
      placed = parallel.place_drafter(drafter, sharded.params, sharded.mesh, "sharded")
      split = sum(not leaf.sharding.is_fully_replicated for k, v in placed.weights.items() if k != "target"
                  for leaf in jax.tree_util.tree_leaves(v))
      print(json.dumps({"kind": "heads", "mesh": spec, "batch": batch, "name": name, "ok": got == ref, "ref": ref,
                        "got": got, "split_leaves": split, "kv_on_model": bool(placed.kv_on_model)}), flush=True)


def law(spec: str) -> None:
  """Sampled speculation (draft model) on a sharded target: the first three tokens of many rows
  fit the exact law (tests/token_law.py), as plain sampling on one device does."""
  from token_law import STAT_NEW, STAT_PROMPT, check_token_law, decoder_law
  from specjax.engine.sampling import SamplingParams
  from flax import nnx
  target = tiny_target()
  pure = nnx.to_pure_dict(target.params)            # LM head x2: peaked laws, drafts accepted more often
  pure["lm_head"]["kernel"] = pure["lm_head"]["kernel"] * 2.0
  nnx.replace_by_pure_dict(target.params, pure)
  n = int(os.environ.get("SPECJAX_LAW_ROWS", "2000"))
  shape = dict(temperature=1.0)
  sampling = SamplingParams.make(n, seed=list(range(10_000, 10_000 + n)), **shape)
  prompts = [STAT_PROMPT] * n
  sharded = api.shard(target, spec)
  drafter, dp = build_drafter("draft", target)
  spec_out = api.generate(sharded, prompts, speculator=drafter, draft_params=dp, chat=False,
                          max_new_tokens=STAT_NEW, sampling=sampling)
  plain = api.generate(target, prompts, chat=False, max_new_tokens=STAT_NEW, sampling=sampling)
  p = check_token_law(decoder_law(target.params, target.cfg, shape), target.cfg.vocab_size, spec_out.tokens,
                      plain.tokens, what=f"sharded speculative sampling ({spec})")
  print(json.dumps({"kind": "law", "mesh": spec, "p": p, "acceptance": spec_out.stats.acceptance_rate}), flush=True)


def train_step(spec: str, tmp: str) -> None:
  """MTP head training (features recomputed by the frozen target inside the step): one step on
  the mesh against one step on one device, then `train` on the mesh interrupted after step 1
  (a sharded orbax checkpoint) and resumed to step 2, against 2 uninterrupted one-device steps."""
  from specjax.drafters.mtp import init_heads
  from specjax.train.loop import TrainConfig, batch_on, make_train_step, place_for_training, train
  from specjax.train.mtp import LossConfig, make_loss_fn
  target = tiny_target()
  cfg = target.cfg
  lc = LossConfig(n_steps=2, batch_size=4, positions_per_row=8, loss="kl", recompute_taps=True)
  loss_fn = make_loss_fn(cfg, lc, 2, jnp.dtype("float32"))
  tc = TrainConfig(steps=2, lr=1e-2, warmup_steps=0, log_every=1, ckpt_every=1)

  def batch(step):
    rows = np.random.default_rng(step).integers(0, cfg.vocab_size, (4, 16)).astype(np.int32)
    return {"tokens": rows, "lens": np.full(4, 16, np.int32), "prompt_lens": np.zeros(4, np.int32)}

  opt, step_fn = make_train_step(loss_fn, tc)

  def one_step(mesh):
    heads, frozen = place_for_training(jax.tree_util.tree_map(jnp.array, init_heads(cfg, 2, seed=1)),
                                       target.params, mesh)
    opt_state = opt.init(heads) if mesh is None else parallel.replicate(opt.init(heads), mesh)
    params, _, metrics = step_fn(heads, opt_state, frozen, batch_on(batch(0), mesh), jnp.int32(0),
                                 jnp.float32(1e-2), jnp.uint32(0))
    return params, metrics

  mesh = parallel.make_mesh(spec)
  (p1, m1), (pm, mm) = one_step(None), one_step(mesh)
  sharded_leaves = sum(not x.sharding.is_fully_replicated for x in jax.tree_util.tree_leaves(pm)) + sum(
      x.sharding.spec != jax.sharding.PartitionSpec() for x in jax.tree_util.tree_leaves(
          place_for_training({}, target.params, mesh)[1]))
  step_diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                  for a, b in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(pm)))
  ref = train(loss_fn, init_heads(cfg, 2, seed=1), target.params, batch, tc, f"{tmp}/one", progress=False)
  train(loss_fn, init_heads(cfg, 2, seed=1), target.params, batch, tc, f"{tmp}/mesh", progress=False,
        stop_at=1, mesh=mesh)
  res = train(loss_fn, init_heads(cfg, 2, seed=1), target.params, batch, tc, f"{tmp}/mesh", progress=False,
              mesh=mesh)
  resume_diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                    for a, b in zip(jax.tree_util.tree_leaves(ref.params), jax.tree_util.tree_leaves(res.params)))
  print(json.dumps({"kind": "train", "mesh": spec, "step_param_diff": step_diff,
                    "loss": [float(m1["loss"]), float(mm["loss"])], "resumed_from": res.resumed_from,
                    "resume_param_diff": resume_diff, "sharded_frozen_leaves": sharded_leaves,
                    "batch_sharding": str(batch_on(batch(0), mesh)["tokens"].sharding.spec)}), flush=True)


def padded(pairs: list[tuple[str, list[str]]], tmp: str) -> None:
  """Greedy tokens on meshes whose model axis does not divide the KV heads (3): the sharded target
  runs padded to 4 KV heads, its drafters keep the 3-KV-head config (the MTP head comes from a head
  file checked against it); each against the one-device plain greedy output, at batch 1."""
  # seed 1: the first prompt's 8 greedy tokens are all different (drafts are accepted and rejected)
  target = LoadedModel(name="tiny", cfg=TINY_PADDED, params=random_params(TINY_PADDED, seed=1))
  prompts = PROMPTS[:1]
  ref = run(target, "plain", prompts)
  for spec, names in pairs:
    sharded = api.shard(target, spec)
    for name in names:
      t0 = time.perf_counter()
      got = run(sharded, name, prompts, head_dir=tmp)
      print(json.dumps({"kind": "padded", "mesh": spec, "name": name, "ok": got == ref, "ref": ref, "got": got,
                        "cfg": [sharded.cfg.n_heads, sharded.cfg.n_kv_heads],
                        "logical": [sharded.logical_cfg.n_heads, sharded.logical_cfg.n_kv_heads],
                        "s": round(time.perf_counter() - t0, 2)}), flush=True)


def real(path: str, spec: str) -> None:
  """The real checkpoint's plain greedy answer (8 tokens) on one device and sharded over `spec`."""
  target = api.load(path)
  prompts = ["What is the capital of France?"]
  ref = api.generate(target, prompts, max_new_tokens=MAX_NEW).tokens
  sharded = api.shard(target, spec)
  got = api.generate(sharded, prompts, max_new_tokens=MAX_NEW).tokens
  print(json.dumps({"kind": "real", "mesh": spec, "ok": got == ref, "ref": ref, "got": got,
                    "cfg": [sharded.cfg.n_heads, sharded.cfg.n_kv_heads],
                    "logical": [sharded.logical_cfg.n_heads, sharded.logical_cfg.n_kv_heads]}), flush=True)


def dist(spec: str, names: list[str]) -> None:
  parallel.initialize_from_env()
  target = api.shard(tiny_target(), spec)
  out = {name: run(target, name, PROMPTS) for name in names}
  if jax.process_index() == 0:
    print(json.dumps({"kind": "dist", "mesh": spec, "processes": jax.process_count(),
                      "devices": len(jax.devices()), "tokens": out}), flush=True)


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  mode, args = sys.argv[1], sys.argv[2:]
  if mode == "greedy":
    names = args[2].split(",") if len(args) > 2 else ["plain", *speculator_spec.names()]
    greedy(int(args[0]), args[1].split(";"), names)
  elif mode == "heads":
    heads(int(args[0]), args[1].split(";"), args[2].split(","))
  elif mode == "law":
    law(args[0])
  elif mode == "train":
    train_step(args[0], args[1])
  elif mode == "padded":
    padded([(m, n.split(",")) for m, n in (p.split(":") for p in args[0].split(";"))], args[1])
  elif mode == "real":
    real(args[0], args[1])
  elif mode == "dist":
    dist(args[0], args[1].split(",") if len(args) > 1 else ["plain", "draft", "suffix"])
  else:
    raise SystemExit(f"unknown mode {mode!r}")
