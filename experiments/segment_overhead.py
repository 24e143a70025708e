"""Issue 11: what adaptive drafting costs beyond its rounds (GPU diagnosis).

In the session-5 adaptive runs on an H100 every host-driven segment took ~8.5 ms more than its
rounds at the warm-up's per-round cost, at batch 64 and at batch 32 alike; the adaptive loop is now
one program (`engine._adaptive_run`). This times that program with the width pinned (0 = plain
decode steps, and 2; one segment of 1, 8 or 32 rounds), the controller choosing among widths with
prohibitive drafting costs (so it decodes plainly, in 16-round segments with the replay and the
width choice between them), and the plain decoding loop with 1, 8 and 32 new tokens, on a
SmolLM2-135M-shaped target with random weights (the cost does not depend on the weights), so the
intercept (ms per call) and the slope (ms per round) come apart. XLA_FLAGS may be varied per run.

  python experiments/segment_overhead.py --out DIR [--batch 64]
  XLA_FLAGS=--xla_gpu_enable_command_buffer= python experiments/segment_overhead.py --out DIR --tag nocmdbuf
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import engine
from specjax.adaptive import AdaptiveConfig
from specjax.bench.env import device_info, git_revision
from specjax.decode import _decode_loop, prefill_jit
from specjax.drafters.ngram_device import NgramSimpleDevice
from specjax.generation import pad_prompts
from specjax.models.config import ModelConfig
from specjax.models.decoder import init_params
from specjax.sampling import SamplingParams
from specjax.drafters.base import DraftParams

SMOLLM2 = ModelConfig(arch="llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                      head_dim=64, ffn_dim=1536, rope_theta=100000.0, tie_embeddings=True)


def _median_ms(setup, fn, repeats: int) -> float:
  """Median wall ms of fn(setup()), the setup (copies of the state) made and finished untimed."""
  ts = []
  for _ in range(repeats):
    args = jax.block_until_ready(setup())
    t0 = time.perf_counter()
    fn(args)
    ts.append((time.perf_counter() - t0) * 1e3)
  return float(np.median(ts))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--prompt", type=int, default=448)
  ap.add_argument("--capacity", type=int, default=1024)
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--tag", default="default")
  a = ap.parse_args()
  cfg, b = SMOLLM2, a.batch
  params = init_params(cfg, 0, jnp.bfloat16)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(0, 1000, a.prompt)) for _ in range(b)]
  tokens, lens = pad_prompts(prompts)
  sampling = SamplingParams.make(b)
  stop = jnp.asarray([-1], jnp.int32)
  big = jnp.full((b,), 10_000, jnp.int32)          # no sequence stops inside a timed call
  drafter = NgramSimpleDevice(size_n=2, size_m=8, width=8)
  dp = {n: jnp.asarray(x) for n, x in DraftParams(n_max=8).arrays(b, 8).items()}
  hist = a.capacity
  state, dstate = engine._spec_prefill(params, (), jnp.asarray(tokens), jnp.asarray(lens), sampling, stop, big,
                                       cfg=cfg, drafter=drafter, capacity=a.capacity, history_len=hist)
  copy = lambda t: jax.tree_util.tree_map(jnp.copy, t)
  rows = []
  ac = AdaptiveConfig(widths=(0, 2, 8))
  costs = jnp.asarray([1.0, 100.0, 100.0], jnp.float32)
  for what, force in (("pinned_w0", 0), ("pinned_w2", 1), ("controller_plain", -1)):
    run = lambda sd, rounds, f=force: int(engine._adaptive_run(
        params, (), sd[0], sd[1], sampling, dp, stop, big, costs, jnp.int32(f), jnp.int32(rounds),
        cfg=cfg, drafter=drafter, rollback="per_step", ac=ac)[3][3])   # rounds run; waits
    fresh = lambda: (copy(state), copy(dstate))
    run(fresh(), 1)                                            # compile + first launch
    for rounds in (1, 8, 32):
      rows.append({"what": what, "rounds": rounds, "ms": _median_ms(fresh, lambda sd: run(sd, rounds), a.repeats)})
      print(rows[-1], flush=True)
  pstate = prefill_jit(params, jnp.asarray(tokens), jnp.asarray(lens), sampling, stop, big, cfg=cfg,
                       capacity=a.capacity, history_len=hist)
  for n in (1, 8, 32):
    mx = jnp.full((b,), n, jnp.int32)
    loop = lambda s: _decode_loop(params, s, sampling, stop, mx, cfg=cfg).hist_len.block_until_ready()
    loop(copy(pstate))
    rows.append({"what": "plain_loop", "rounds": n, "ms": _median_ms(lambda: copy(pstate), loop, a.repeats)})
    print(rows[-1], flush=True)
  fit = {}
  for what in sorted({r["what"] for r in rows}):
    pts = [(r["rounds"], r["ms"]) for r in rows if r["what"] == what and r["rounds"] > 0]
    slope, icpt = np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)
    fit[what] = {"ms_per_round": float(slope), "ms_per_call": float(icpt)}
  print(json.dumps(fit, indent=1))
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, f"segment_overhead_{a.tag}_b{b}.json"), "w") as f:
    json.dump({"experiment": "segment_overhead", "config": vars(a), "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "git_revision": git_revision(), "device": device_info(), "rows": rows, "fit": fit}, f, indent=1)


if __name__ == "__main__":
  main()
