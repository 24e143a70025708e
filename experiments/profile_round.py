"""Where the time of one speculative round goes (issue 10, item 1): each piece jitted alone and
timed on its own, for SmolLM2-135M (real weights if fetched, else random) and the Qwen2.5-Coder
1.5B / 0.5B shapes (random bf16 weights: timing does not depend on values).

  python experiments/profile_round.py --out experiments/results/profile_round_h200.json

Pieces: target decode step (T=1); target verification forward (T=K+1); shaping p + rejection
sampling; emission + KV rollback; device ngram lookup; one draft-model step (0.5B shapes).
Median of --repeats timed calls after a warm-up, each call blocked until ready.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.bench.env import device_info, git_revision  # noqa: E402
from specjax.bench.timing import time_call  # noqa: E402
from specjax.drafters.ngram_device import ngram_lookup  # noqa: E402
from specjax.engine.generation import GenState, emit  # noqa: E402
from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.decoder import forward, init_params  # noqa: E402
from specjax.engine.sampling import SamplingParams, shaped_probs  # noqa: E402
from specjax.models.kv_cache import KVCache  # noqa: E402
from specjax.engine.verify import accept_drafts  # noqa: E402

QWEN15 = ModelConfig(arch="qwen2", vocab_size=151936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2,
                     head_dim=128, ffn_dim=8960, rope_theta=1e6, qkv_bias=True)
QWEN05 = ModelConfig(arch="qwen2", vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                     head_dim=64, ffn_dim=4864, rope_theta=1e6, qkv_bias=True)
SMOL = ModelConfig(arch="llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                   head_dim=64, ffn_dim=1536, rope_theta=1e5, tie_embeddings=True)


def timeit(fn, *args, repeats: int) -> float:
  return time_call(fn, args, repeats, iters=1)


def profile(name, cfg, params, batch, ctx, ks, repeats, dtype):
  cap = ctx + 64
  cache = KVCache.init(cfg, batch, cap, dtype).with_lengths(jnp.full((batch,), ctx, jnp.int32))
  rows = []
  fwd = jax.jit(lambda p, t, c: forward(p, cfg, t, c)[0])
  t1 = timeit(fwd, params, jnp.ones((batch, 1), jnp.int32), cache, repeats=repeats)
  rows.append({"model": name, "piece": "target decode step (T=1)", "batch": batch, "context": ctx, "k": 0, "ms": t1})
  sampling = SamplingParams.make(batch, temperature=0.0)
  keys = jnp.zeros((batch, 2), jnp.uint32)
  for k in ks:
    tv = timeit(fwd, params, jnp.ones((batch, k + 1), jnp.int32), cache, repeats=repeats)
    logits = jax.random.normal(jax.random.key(0), (batch, k + 1, cfg.vocab_size), jnp.float32)
    draft = jnp.ones((batch, k), jnp.int32)
    acc = jax.jit(lambda lg, d: accept_drafts(shaped_probs(lg, sampling), d, jnp.full((batch,), k), keys))
    ta = timeit(acc, logits, draft, repeats=repeats)
    hist = jax.random.randint(jax.random.key(1), (batch, cap), 0, 50)
    state = GenState(cache=cache, history=hist, hist_len=jnp.full((batch,), ctx), prompt_len=jnp.zeros((batch,), jnp.int32),
                     last=jnp.zeros((batch,), jnp.int32), keys=keys, done=jnp.zeros((batch,), bool))
    em = jax.jit(lambda s, t: emit(s.__class__(**{**s.__dict__, "cache": s.cache.with_lengths(s.cache.lengths + 1)}),
                                   t, jnp.full((batch,), k + 1), jnp.asarray([-1]), jnp.full((batch,), 10 ** 6))[0].hist_len)
    te = timeit(em, state, jnp.ones((batch, k + 1), jnp.int32), repeats=repeats)
    ng = jax.jit(lambda h, l: ngram_lookup(h, l, 3, k, jnp.full((batch,), k), k))
    tn = timeit(ng, hist, jnp.full((batch,), ctx), repeats=repeats)
    for piece, ms in ((f"target verify forward (T=K+1)", tv), ("shape p + rejection sampling", ta),
                      ("emit + rollback", te), ("device ngram lookup", tn)):
      rows.append({"model": name, "piece": piece, "batch": batch, "context": ctx, "k": k, "ms": ms})
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  ap.add_argument("--context", type=int, default=1024)
  ap.add_argument("--k", type=int, nargs="+", default=[4, 8, 16])
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  dtype = jnp.bfloat16
  rows = []
  models = [("smollm2-135m (random bf16)", SMOL), ("qwen2.5-coder-1.5b shapes (random bf16)", QWEN15),
            ("qwen2.5-coder-0.5b shapes (random bf16)", QWEN05)]
  for name, cfg in models:
    params = init_params(cfg, 0, dtype=dtype)
    for b in args.batch:
      ks = args.k if "0.5b" not in name else [0]
      if "0.5b" in name:   # the drafter: one decode step is what a draft step costs
        cache = KVCache.init(cfg, b, args.context + 64, dtype).with_lengths(jnp.full((b,), args.context, jnp.int32))
        fwd = jax.jit(lambda p, t, c: forward(p, cfg, t, c)[0])
        ms = timeit(fwd, params, jnp.ones((b, 1), jnp.int32), cache, repeats=args.repeats)
        rows.append({"model": name, "piece": "draft model step (T=1)", "batch": b, "context": args.context, "k": 0, "ms": ms})
      else:
        rows += profile(name, cfg, params, b, args.context, ks, args.repeats, dtype)
      for r in rows[-1:]:
        print(r, flush=True)
    del params
  for r in rows:
    print(f"{r['model'][:28]:28s} b={r['batch']:<3d} k={r['k']:<3d} {r['piece']:34s} {r['ms']:8.3f} ms")
  out = {"experiment": "profile_round", "config": vars(args), "git_revision": git_revision(),
         "device": device_info(), "results": rows}
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
