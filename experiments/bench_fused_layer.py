"""The fused decoder layer (specjax/models/fused_layer.py) against the XLA layer, side by side.

  OUT=... bash experiments/gpu/bootstrap.sh python experiments/bench_fused_layer.py --out $OUT/fused_layer.json
  python experiments/bench_fused_layer.py --interpret --tiny --out /tmp/fused_layer.json   # CPU smoke test

SmolLM2-135M shapes (d_model 576, 30 layers, 9 / 3 heads of 64, ffn 1536, vocab 49152, tied
embeddings), random bf16 weights, a KV cache of `--context` committed slots per sequence:

(a) layer: one decoder layer's decode step (norms, projections, rotary, KV write, attention,
    residual adds), XLA (`decoder.Block`) vs fused (`fused_layer.fused_block`);
(b) model: a whole decode step (embedding, every layer, final norm, LM head, greedy argmax),
    `decoder.forward` vs `fused_layer.forward(fused=True)`.

Each implementation runs `--steps` dependent steps inside one jitted fori_loop (launch costs are
the device's, as in the engine's decode loop; the cache is donated and stays at `--context`
slots), and the median over `--repeats` loops is the time per step. Both implementations use the
same attention (`verify_attention.attention`: the Pallas kernel on a GPU under auto). Before
timing, one model step's logits are compared (max |fused - xla|, greedy agreement).
Writes --out JSON (config, git revision, device, environment, rows) and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.bench.env import device_info, environment, git_revision  # noqa: E402
from specjax.kernels import fused_decode  # noqa: E402
from specjax.models import fused_layer  # noqa: E402
from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.decoder import attention_masks, forward, init_params, model_of  # noqa: E402
from specjax.models.kv_cache import KVCache  # noqa: E402

SMOLLM2 = ModelConfig(arch="llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                      head_dim=64, ffn_dim=1536, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True)
TINY = ModelConfig(arch="llama", vocab_size=64, d_model=72, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                   ffn_dim=80, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True)


def filled_cache(cfg, batch: int, capacity: int, context: int, dtype, seed: int) -> KVCache:
  """A cache with `context` committed slots of random K/V per sequence."""
  keys = jax.random.split(jax.random.key(seed), 2 * cfg.n_layers)
  shape = (batch, capacity, cfg.n_kv_heads, cfg.head_dim)
  kv = [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys]
  return KVCache(k=tuple(kv[:cfg.n_layers]), v=tuple(kv[cfg.n_layers:]),
                 lengths=jnp.full((batch,), context, jnp.int32))


def layer_loop(cfg, steps: int, fused: bool, interpret: bool | None):
  """(params, x [B, T, d], k, v [B, S, KVH, D], lengths) -> the same after `steps` applications
  of layer 0 (the K/V of each step written at the same slots, so the context stays fixed)."""
  def run(params, x, k, v, lengths):
    b, t, _ = x.shape
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    masks = attention_masks(cfg, lengths, positions, k.shape[1])
    block = model_of(params, cfg).layers[0]

    def body(_, carry):
      x, k, v = carry
      write = functools.partial(KVCache(k=(k,), v=(v,), lengths=lengths).write, 0)
      if fused:
        x, (k, v) = fused_layer.fused_block(block, x, positions, write, masks, {}, interpret=interpret)
      else:
        x, (k, v) = block(x, positions, write, masks)
      return x, k, v
    return jax.lax.fori_loop(0, steps, body, (x, k, v))
  return jax.jit(run, donate_argnums=(2, 3))


def model_loop(cfg, steps: int, fused: bool, interpret: bool | None):
  """(params, tokens [B, T], cache) -> (tokens, cache) after `steps` greedy decode steps at a fixed
  context (lengths restored after each step)."""
  def run(params, tokens, cache):
    def body(_, carry):
      tokens, cache = carry
      logits, _, new = fused_layer.forward(params, cfg, tokens, cache, fused=fused, interpret=interpret)
      nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)                        # [B, T]
      return nxt, new.with_lengths(cache.lengths)
    return jax.lax.fori_loop(0, steps, body, (tokens, cache))
  return jax.jit(run, donate_argnums=(2,))


def timed(fn, args, donated: tuple[int, ...], repeats: int, steps: int) -> list[float]:
  """ms per step of each of `repeats` runs after one warm-up (the donated outputs feed the next run)."""
  args = list(args)

  def once():
    out = jax.block_until_ready(fn(*args))
    out = out if isinstance(out, tuple) else (out,)
    for i, o in zip(donated, out[-len(donated):]):
      args[i] = o
  once()                                                                          # compile + warm-up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    once()
    times.append((time.perf_counter() - t0) / steps * 1e3)
  return times


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
  ap.add_argument("--tokens", type=int, default=1, help="new tokens per sequence (1: decode; K+1: verification)")
  ap.add_argument("--context", type=int, default=512, help="committed slots per sequence")
  ap.add_argument("--steps", type=int, default=64, help="steps per timed loop")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--skip", nargs="*", default=[], choices=["layer", "model"])
  ap.add_argument("--tiny", action="store_true", help="a tiny config, 2 steps, batch 1 2 (CPU smoke test)")
  ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (off a GPU it is anyway)")
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  if args.tiny:
    args.batch, args.context, args.steps, args.repeats = [1, 2], 8, 2, 1
  cfg = TINY if args.tiny else SMOLLM2
  interpret = True if args.interpret else None
  dtype = jnp.dtype(args.dtype)
  t = args.tokens
  capacity = args.context + t
  params = init_params(cfg, seed=0, dtype=dtype)
  result = {"experiment": "fused_layer", "config": vars(args), "model_config": repr(cfg),
            "git_revision": git_revision(), "device": device_info(), "environment": environment(), "rows": []}

  def save():
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))

  rng = np.random.default_rng(0)
  for b in args.batch:
    rows = b * t
    row = {"batch": b, "tokens": t, "rows": rows, "context": args.context,
           "fused_serves": fused_layer.serves(cfg, rows, fused=True)}
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    # agreement of one model step
    cache = filled_cache(cfg, b, capacity, args.context, dtype, seed=b)
    ref = jax.jit(lambda p, x, c: forward(p, cfg, x, c)[0])(params, tokens, cache)
    got = jax.jit(lambda p, x, c: fused_layer.forward(p, cfg, x, c, fused=True, interpret=interpret)[0])(
        params, tokens, cache)
    row["logits_max_abs_diff"] = float(jnp.max(jnp.abs(got - ref)))
    row["greedy_agreement"] = float(jnp.mean(jnp.argmax(got, -1) == jnp.argmax(ref, -1)))
    del cache
    for what in ("layer", "model"):
      if what in args.skip:
        continue
      for impl in ("xla", "fused"):
        fused = impl == "fused"
        cache = filled_cache(cfg, b, capacity, args.context, dtype, seed=b)
        if what == "layer":
          x = jnp.asarray(rng.standard_normal((b, t, cfg.d_model)), jnp.float32)
          fn = layer_loop(cfg, args.steps, fused, interpret)
          ms = timed(fn, (params, x, cache.k[0], cache.v[0], cache.lengths), (2, 3), args.repeats, args.steps)
        else:
          fn = model_loop(cfg, args.steps, fused, interpret)
          ms = timed(fn, (params, tokens, cache), (2,), args.repeats, args.steps)
        row[f"{what}_{impl}_ms"] = statistics.median(ms)
        row[f"{what}_{impl}_all_ms"] = ms
        del cache
      row[f"{what}_speedup"] = row[f"{what}_xla_ms"] / row[f"{what}_fused_ms"]
      print(f"batch {b:3d} x {t} tokens  {what:5s}: xla {row[f'{what}_xla_ms']:8.3f} ms  "
            f"fused {row[f'{what}_fused_ms']:8.3f} ms  ({row[f'{what}_speedup']:.2f}x)"
            f"{'' if row['fused_serves'] else '  [fused layer not serving: XLA both]'}", flush=True)
    print(f"batch {b:3d}: one model step, max |fused - xla| logits {row['logits_max_abs_diff']:.3g}, "
          f"greedy agreement {row['greedy_agreement']:.3f}", flush=True)
    result["rows"].append(row)
    save()
  result["max_rows"] = fused_decode.MAX_ROWS
  save()


if __name__ == "__main__":
  main()
