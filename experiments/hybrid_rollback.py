"""Issue 6: time and memory of one speculative round on a hybrid target, `per_step` vs `redecode`
rollback, against draft length K.

A round here is what the engine does to the target per round: verification of [last, d1..dK]
(`HybridTarget.verify`) and the rollback to the accepted length (`HybridTarget.commit`), jitted
together. Shapes are Qwen3.5-0.8B-like (24 layers, 3 gated-DeltaNet : 1 gated attention), random bf16
weights: time and memory do not depend on the values. Three acceptance patterns per K:
  partial  every sequence keeps a random 1..K tokens (redecode must re-run: its worst case),
  all      every sequence keeps all K+1 (redecode keeps the verification state: its best case),
  none     every sequence keeps only the bonus token (n_keep = 1: redecode re-runs).
Memory: XLA's compiled temp allocation of the round plus its output (what the round adds on top of
the parameters and the incoming state), and the bytes of the recurrent checkpoint each mode holds.

  python experiments/hybrid_rollback.py --out experiments/results/hybrid_rollback_h200.json
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
from specjax.bench.env import device_info, git_revision  # noqa: E402
from specjax.models.hybrid import HybridTarget, hybrid_forward, init_params  # noqa: E402
from specjax.models.hybrid_config import HybridConfig  # noqa: E402
from specjax.models.recurrent_state import HybridState  # noqa: E402

QWEN35_08B_LIKE = HybridConfig(
    arch="qwen3_5", vocab_size=248320, d_model=1024, n_layers=24,
    layer_types=tuple("full" if i % 4 == 3 else "linear" for i in range(24)),
    n_heads=8, n_kv_heads=2, head_dim=256, ffn_dim=3584, lin_k_heads=16, lin_v_heads=16,
    lin_k_dim=128, lin_v_dim=128, rotary_dim=64, tie_embeddings=True)
TINY = QWEN35_08B_LIKE.replace(vocab_size=512, d_model=64, n_layers=4, layer_types=("linear", "linear", "linear", "full"),
                               n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=128, lin_k_heads=2, lin_v_heads=2,
                               lin_k_dim=16, lin_v_dim=16, rotary_dim=16)


def time_rounds(fn, params, tokens, state, n_keep, repeats: int):
  """Median ms of a round. The round takes the state donated and returns the new one, as the
  engine's loop carries it (in place, nothing copied, nothing dead-code-eliminated); each call
  starts where the last one ended. Returns (ms, state)."""
  _, state = jax.block_until_ready(fn(params, tokens, state, n_keep))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    _, state = jax.block_until_ready(fn(params, tokens, state, n_keep))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3, state


def round_fn(cfg, mode):
  target = HybridTarget(mode)

  def run(params, tokens, state, n_keep):
    logits, _, after, ckpt = target.verify(params, cfg, tokens, state)
    new = target.commit(params, cfg, tokens, state, after, ckpt, n_keep)
    return logits[:, :, :8], new     # the whole new state is live: no part of the rollback is eliminated
  return jax.jit(run, donate_argnums=(2,))


def nbytes_of(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
  ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8, 12, 16])
  ap.add_argument("--context", type=int, default=1024)
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
  ap.add_argument("--out", required=True)
  ap.add_argument("--rows-from", default=None,
                  help="build the JSON + plot from rows this script printed (a run cut short by a time limit)")
  ap.add_argument("--device-kind", default=None, help="with --rows-from: the card the rows were measured on")
  args = ap.parse_args(argv)
  cfg = TINY if args.tiny else QWEN35_08B_LIKE
  if args.rows_from:
    rows = [json.loads(line) for line in Path(args.rows_from).read_text().splitlines() if line.startswith("{")]
    device = {"device_kind": args.device_kind, "note": f"rows printed by a run on that card, read from {args.rows_from}"}
    return finish(rows, args, cfg, device)
  params = init_params(cfg, seed=0, dtype=jnp.bfloat16)
  rng = np.random.default_rng(0)
  rows = []
  for b in args.batch:
    cap = args.context + (3 * (args.repeats + 1) + 2) * (max(args.k) + 1) + 64
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, args.context)), jnp.int32)
    prefill = jax.jit(functools.partial(hybrid_forward, cfg=cfg))
    for k in args.k:
      tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, k + 1)), jnp.int32)
      keeps = {"partial": jnp.asarray(rng.integers(1, k + 1, b), jnp.int32),
               "all": jnp.full((b,), k + 1, jnp.int32), "none": jnp.ones((b,), jnp.int32)}
      for mode in ("per_step", "redecode"):
        fn = round_fn(cfg, mode)
        state = prefill(params, tokens=prompt, state=HybridState.init(cfg, b, cap, jnp.bfloat16))[2]
        mem = fn.lower(params, tokens, state, keeps["all"]).compile().memory_analysis()
        temp = int(getattr(mem, "temp_size_in_bytes", 0) or 0) if mem is not None else None
        ckpt = nbytes_of(state.conv + state.rec) * ((k + 1) if mode == "per_step" else 1)
        row = {"mode": mode, "batch": b, "k": k, "context": args.context, "temp_bytes": temp,
               "recurrent_checkpoint_bytes": ckpt}
        for name, n_keep in keeps.items():
          row[f"ms_{name}"], state = time_rounds(fn, params, tokens, state, n_keep, repeats=args.repeats)
        rows.append(row)
        print(json.dumps(row), flush=True)
  return finish(rows, args, cfg, device_info())


def finish(rows, args, cfg, device) -> int:
  verdict = []
  for b in sorted({r["batch"] for r in rows}):
    for k in sorted({r["k"] for r in rows if r["batch"] == b}):
      pair = [[r for r in rows if r["batch"] == b and r["k"] == k and r["mode"] == m] for m in ("per_step", "redecode")]
      if not all(pair):
        continue
      ps, rd = ([r for r in rows if r["batch"] == b and r["k"] == k and r["mode"] == m][0] for m in ("per_step", "redecode"))
      verdict.append({"batch": b, "k": k,
                      "faster_partial": "per_step" if ps["ms_partial"] < rd["ms_partial"] else "redecode",
                      "faster_all": "per_step" if ps["ms_all"] < rd["ms_all"] else "redecode",
                      "redecode_over_per_step_partial": rd["ms_partial"] / ps["ms_partial"],
                      "per_step_extra_temp_mib": ((ps["temp_bytes"] or 0) - (rd["temp_bytes"] or 0)) / 2**20})
  out = {"experiment": "hybrid_rollback", "model": "Qwen3.5-0.8B-like shapes, random bf16 weights" if not args.tiny else "tiny",
         "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()},
         "args": vars(args), "git_revision": git_revision(), "device": device, "rows": rows, "verdict": verdict}
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
  plot(out, Path(args.out).with_suffix(".png"))
  return 0


def plot(out: dict, png: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  batches = sorted({r["batch"] for r in out["rows"]})
  fig, axes = plt.subplots(2, len(batches), figsize=(5.5 * len(batches), 7), squeeze=False)
  for j, b in enumerate(batches):
    for mode, color in (("per_step", "tab:blue"), ("redecode", "tab:orange")):
      rs = [r for r in out["rows"] if r["batch"] == b and r["mode"] == mode]
      ks = [r["k"] for r in rs]
      axes[0, j].plot(ks, [r["ms_partial"] for r in rs], "-o", color=color, label=f"{mode}: partial acceptance")
      axes[0, j].plot(ks, [r["ms_all"] for r in rs], "--", color=color, label=f"{mode}: all accepted")
      axes[1, j].plot(ks, [(r["temp_bytes"] or 0) / 2**20 for r in rs], "-o", color=color, label=f"{mode}: XLA temp")
      axes[1, j].plot(ks, [r["recurrent_checkpoint_bytes"] / 2**20 for r in rs], ":", color=color,
                      label=f"{mode}: recurrent checkpoint")
    axes[0, j].set_title(f"batch {b}, context {out['args']['context']}")
    axes[0, j].set_ylabel("ms per round (verify + rollback)")
    axes[1, j].set_ylabel("MiB")
    for ax in axes[:, j]:
      ax.set_xlabel("draft length K")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
  fig.suptitle(f"hybrid rollback: {out['model']} on {out['device'].get('device_kind', '?')}")
  fig.tight_layout()
  fig.savefig(png, dpi=110)


if __name__ == "__main__":
  sys.exit(main())
