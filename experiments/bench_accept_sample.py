"""The accept / resample step on the GPU (issue 10, item 3): the Pallas kernel against the XLA reference.

  python experiments/bench_accept_sample.py --out "$OUT"            # on the GPU machine
  SMOKE=1 python experiments/bench_accept_sample.py --out /tmp/as   # tiny CPU run (interpret mode)

For batch 1/8/32/64, K 4/8/16, V = 49152 (SmolLM2's vocabulary): target probabilities p [B, K+1, V]
(float32, what `shaped_probs` returns; bf16 as a variant), drafts with ragged lengths, and either
draft distributions q [B, K, V] (model drafters) or none (deterministic drafters such as n-grams).
Two timings per shape and implementation, each as `--iters` dependent calls inside one jitted
fori_loop (median of `--repeats`):
- "step": `specjax.engine.verify.accept_drafts` from the sampler keys, as the engine runs it (uniforms
  and Gumbel noise drawn in XLA, then the kernel or the reference);
- "core": the step from pre-drawn noise (`pallas_accept_sample` vs `accept_sample_reference`).
The fraction of rows where kernel and reference agree (count and token) is recorded too.

Writes accept_sample_<card>.json and .png into --out (partial JSON after every dtype).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.bench.env import device_info, git_revision  # noqa: E402
from specjax.bench.timing import time_call  # noqa: E402
from specjax.kernels import accept_sample as asl  # noqa: E402
from specjax.kernels.dispatch import on_gpu  # noqa: E402
from specjax.engine.verify import accept_drafts  # noqa: E402


def inputs(b: int, k: int, v: int, dtype, has_q: bool, seed: int = 0):
  """Peaked random distributions (so that drafts are often accepted), drafts, lengths, keys, noise."""
  rng = np.random.default_rng(seed)
  logits = rng.standard_normal((b, k + 1, v), np.float32) * 4
  p = jax.nn.softmax(jnp.asarray(logits), axis=-1)                              # [B, K+1, V] f32
  q = jax.nn.softmax(jnp.asarray(logits[:, :k] + rng.standard_normal((b, k, v), np.float32)), axis=-1)
  draft = jnp.argmax(q, axis=-1).astype(jnp.int32)                              # [B, K]
  dlen = jnp.asarray(rng.integers(1, k + 1, b), jnp.int32)
  keys = jax.random.key_data(jax.random.split(jax.random.key(seed), b))          # [B, 2]
  u = jnp.asarray(rng.random((b, k), np.float32))
  g = jnp.asarray(rng.gumbel(size=(b, v)).astype(np.float32))
  return p.astype(dtype), draft, dlen, keys, u, g, (q.astype(dtype) if has_q else None)


def looped(step, iters: int):
  """jit: (first call's output, drafts after `iters` dependent calls). step(draft) -> (n_acc, tok)."""
  def run(draft, *rest):
    first = step(draft, *rest)
    def body(i, d):
      n_acc, tok = step(d, *rest)
      return jnp.where((tok + n_acc < 0)[:, None], d + 1, d)                   # same drafts, but a data dependence
    return first, jax.lax.fori_loop(0, iters, body, draft)
  return jax.jit(run)


def bench(args, budget_s: float, result: dict, save) -> None:
  rows = result["micro"]
  t_start = time.perf_counter()
  interpret = not on_gpu()
  variants = [(jnp.float32, False), (jnp.float32, True)] + [(jnp.bfloat16, True)] * args.bf16
  for dtype, has_q in variants:
    for b in args.batch:
      for k in args.k:
        row = {"batch": b, "k": k, "vocab": args.vocab, "dtype": jnp.dtype(dtype).name,
               "drafts": "with q" if has_q else "deterministic (q = None)"}
        if time.perf_counter() - t_start > budget_s:
          rows.append({**row, "skipped": "time budget"})
          continue
        p, draft, dlen, keys, u, g, q = inputs(b, k, args.vocab, dtype, has_q)
        tiling = asl.tiling_for(b, k, args.vocab)
        try:
          for label, impl in (("xla", "xla"), ("pallas", "pallas")):
            asl.set_impl(impl)                                                  # read when the step is traced
            step = looped(lambda d, p, dlen, keys, q: accept_drafts(p, d, dlen, keys, q), args.iters)
            row[f"step_{label}_ms"] = time_call(step, (draft, p, dlen, keys, q), args.repeats, args.iters)
          asl.set_impl(None)
          ref = looped(lambda d, p, dlen, u, g, q: asl.accept_sample_reference(p, d, dlen, u, g, q), args.iters)
          ker = looped(lambda d, p, dlen, u, g, q: asl.pallas_accept_sample(p, d, dlen, u, g, q, tiling=tiling,
                                                                           interpret=interpret), args.iters)
          row["core_xla_ms"] = time_call(ref, (draft, p, dlen, u, g, q), args.repeats, args.iters)
          row["core_pallas_ms"] = time_call(ker, (draft, p, dlen, u, g, q), args.repeats, args.iters)
          row["step_speedup"] = row["step_xla_ms"] / row["step_pallas_ms"]
          row["core_speedup"] = row["core_xla_ms"] / row["core_pallas_ms"]
          (n_w, t_w), (n_g, t_g) = ref(draft, p, dlen, u, g, q)[0], ker(draft, p, dlen, u, g, q)[0]
          row["agree"] = float(jnp.mean((n_w == n_g) & (t_w == t_g)))
          row["mean_accepted"] = float(jnp.mean(n_w))
          row["tiling"] = dataclasses.asdict(tiling)
        except Exception as e:  # noqa: BLE001 - record and go on: one failing shape must not lose the rest
          row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        finally:
          asl.set_impl(None)
        rows.append(row)
        print({x: (round(y, 4) if isinstance(y, float) else y) for x, y in row.items() if x != "tiling"}, flush=True)
    save()


def plot(result: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [r for r in result["micro"] if "step_speedup" in r]
  variants = list(dict.fromkeys((r["dtype"], r["drafts"]) for r in rows))
  fig, axes = plt.subplots(1, max(1, len(variants)), figsize=(6 * max(1, len(variants)), 4.5), squeeze=False)
  for ax, (dtype, drafts) in zip(axes[0], variants):
    sel = [r for r in rows if (r["dtype"], r["drafts"]) == (dtype, drafts)]
    labels = [f"B{r['batch']}\nK{r['k']}" for r in sel]
    x = np.arange(len(sel))
    ax.bar(x - 0.2, [r["step_speedup"] for r in sel], 0.4, label="step (from keys)")
    ax.bar(x + 0.2, [r["core_speedup"] for r in sel], 0.4, label="core (pre-drawn noise)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("XLA time / kernel time")
    ax.set_title(f"p {dtype}, {drafts}, V={result['config']['vocab']}")
    ax.legend(fontsize=7)
  fig.suptitle(f"accept / resample step, {result['device']['device_kind']} ({result['git_revision']})")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  smoke = os.environ.get("SMOKE") == "1"
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True)
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64] if not smoke else [2])
  ap.add_argument("--k", type=int, nargs="+", default=[4, 8, 16] if not smoke else [4])
  ap.add_argument("--vocab", type=int, default=49152 if not smoke else 300)
  ap.add_argument("--bf16", type=int, default=1, help="also time bf16 probabilities (with q): 1 / 0")
  ap.add_argument("--iters", type=int, default=20 if not smoke else 2)
  ap.add_argument("--repeats", type=int, default=5 if not smoke else 1)
  ap.add_argument("--budget-s", type=float, default=150)
  args = ap.parse_args(argv)
  out_dir = Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  dev = device_info()
  card = dev["device_kind"].lower().replace("nvidia ", "").replace(" ", "_")
  path = out_dir / f"accept_sample_{card}.json"
  result = {"experiment": "accept_sample", "config": vars(args), "smoke": smoke, "git_revision": git_revision(),
            "device": dev, "micro": []}

  def save():
    path.write_text(json.dumps(result, indent=1))
    plot(result, path.with_suffix(".png"))

  bench(args, args.budget_s, result, save)
  save()
  done = [r for r in result["micro"] if "step_speedup" in r]
  if done:
    print(f"step speedup median {statistics.median(r['step_speedup'] for r in done):.2f}x "
          f"(min {min(r['step_speedup'] for r in done):.2f}x), core median "
          f"{statistics.median(r['core_speedup'] for r in done):.2f}x, agreement min "
          f"{min(r['agree'] for r in done):.4f} over {len(done)} shapes")
  print("wrote", path)


if __name__ == "__main__":
  main()
