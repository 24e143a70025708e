"""Verification attention on the GPU (issue 10, item 2): the Pallas kernel against the XLA reference.

  python experiments/bench_verify_attention.py --out "$OUT"            # on the GPU machine
  SMOKE=1 python experiments/bench_verify_attention.py --out /tmp/va   # tiny CPU run (interpret mode)

1. Kernel time: one attention call (SmolLM2 heads 9/3 x 64, Qwen2.5-1.5B heads 12/2 x 128, bf16)
   for context 1k/4k/16k (committed slots; capacity = context + 64), K 0 (one-token decode), 4, 8,
   16 (T = K+1 causal), batch 1/8/32. Each implementation runs `--iters` dependent calls inside
   one jitted fori_loop (so launch overhead is the device's, as inside a model, not Python's); the
   median of `--repeats` loops over iters is the time per call. The max |kernel - reference| of
   the first call is recorded too.
2. End to end: speculative decoding of SmolLM2-135M-Instruct (real weights, bf16) with the device
   ngram_simple drafter, n_max 8, greedy, the first turn of `--questions` MT-bench questions, batch
   1 and 8, cache capacity `--capacity`: tokens/s with the XLA reference and with the kernel
   (`auto`: what a user gets), in one process; outputs compared token for token.

Options for issue 10's second pass (experiments/gpu_kernels2.sh): `--previous-splits` also times the
kernel under the split rule before the batch-1 change; `--e2e-settings off on attention` compares
every kernel off, every kernel on (verification attention + accept/resample, `auto`) and the
attention kernel alone (default `xla auto`: the attention kernel only, as in item 2's runs);
`--skip-micro`; `--tag` names the files.

Writes verify_attention[_<tag>]_<card>.json and .png into --out (partial JSON after every section; each
section stops starting new work past its time budget).
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
from specjax.kernels import verify_attention as va  # noqa: E402
from specjax.kernels.dispatch import on_gpu  # noqa: E402

MODELS = {"smollm2-135m": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128)}   # (q heads, kv heads, head_dim)


# end-to-end settings: implementation of each kernel (None: leave the kernel's own setting)
SETTINGS = {
    "xla": {"verify_attention": "xla", "accept_sample": None},       # attention only (item 2's runs)
    "auto": {"verify_attention": "auto", "accept_sample": None},
    "off": {"verify_attention": "xla", "accept_sample": "xla"},      # every kernel off
    "on": {"verify_attention": "auto", "accept_sample": "pallas"},   # every kernel on (accept_sample is opt-in)
    "attention": {"verify_attention": "auto", "accept_sample": "xla"},  # as a user gets it under auto
}


def previous_tiling(b, t, h, kvh, d, cap) -> va.Tiling:
  """The split rule before the batch-1 change (at most 64 splits, blocks of 128 / 64 by the
  accumulator only), for comparison."""
  tl = va.tiling_for(b, t, h, kvh, d, cap)
  block_k = 64 if tl.block_m * d >= 8192 else 128
  per_split = b * kvh * (tl.rows // tl.block_m)
  n_splits = max(1, min(64, -(-2 * va.dispatch.sm_count() // per_split), -(-cap // block_k)))
  return dataclasses.replace(tl, block_k=block_k, n_splits=n_splits)


def candidate_tilings(tl: va.Tiling, batch: int, kvh: int, cap: int) -> list[va.Tiling]:
  """Other split plans for the same shape (blocks of 64 / 128 slots, programs over the committed
  slots for about a half, one or two per SM, or at least 2 / 4 blocks per split), to time beside
  the current rule (`--split-candidates`)."""
  per_split = batch * kvh * (tl.rows // tl.block_m)
  sm = va.dispatch.sm_count()
  plans = set()
  for block_k in (64, 128):
    n_blocks = -(-cap // block_k)
    for want in (-(-sm // (2 * per_split)), -(-sm // per_split), -(-2 * sm // per_split),
                 n_blocks // 2, n_blocks // 4):
      plans.add((block_k, max(1, min(want, n_blocks, va.MAX_SPLITS))))
  return [dataclasses.replace(tl, block_k=bk, n_splits=ns) for bk, ns in sorted(plans)
          if (bk, ns) != (tl.block_k, tl.n_splits)]


def looped(attn, iters: int):
  """jit: (first call's output, q after `iters` dependent calls). attn(q, k, v, mask, ragged)."""
  def run(q, k, v, mask, ragged):
    first = attn(q, k, v, mask, ragged)                                          # [B, T, H, D] f32
    body = lambda i, x: (x.astype(jnp.float32) + 1e-3 * attn(x, k, v, mask, ragged)).astype(x.dtype)
    return first, jax.lax.fori_loop(0, iters, body, q)
  return jax.jit(run)


def micro(args, budget_s: float) -> list[dict]:
  rows, t_start = [], time.perf_counter()
  interpret = not on_gpu()
  rank = {4096: 0, 16384: 1}                       # the bar's contexts first, should time run out
  groups = sorted(((ctx, model, batch) for model in args.models for batch in args.batch for ctx in args.context),
                  key=lambda g: (rank.get(g[0], 2), g[1], g[2]))
  for ctx, model, batch in groups:
    h, kvh, d = MODELS[model]
    scale = d ** -0.5
    cap = ctx + 64
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((batch, cap, kvh, d), np.float32), jnp.bfloat16)   # [B, S, KVH, D]
    v = jnp.asarray(rng.standard_normal((batch, cap, kvh, d), np.float32), jnp.bfloat16)
    for kk in sorted(args.k, key=lambda x: (x == 0, x)):   # K = 0 (decode) last
      t = kk + 1
      row = {"model": model, "heads": [h, kvh, d], "batch": batch, "context": ctx, "capacity": cap, "k": kk}
      if time.perf_counter() - t_start > budget_s:
        rows.append({**row, "skipped": "time budget"})
        continue
      q = jnp.asarray(rng.standard_normal((batch, t, h, d), np.float32), jnp.bfloat16)      # [B, T, H, D]
      ragged = va.RaggedMask(jnp.full((batch,), ctx, jnp.int32), va.causal_new_mask(batch, t))
      mask = va.dense_visibility(ragged, cap)                                # [B, T, S], built once
      tiling = va.tiling_for(batch, t, h, kvh, d, cap)
      ref = looped(lambda q, k, v, m, r: va.attend_reference(q, k, v, m, scale), args.iters)
      ker = looped(lambda q, k, v, m, r: va.pallas_verify_attention(q, k, v, r, scale, tiling=tiling,
                                                                    interpret=interpret), args.iters)
      try:
        row["xla_ms"] = time_call(ref, (q, k, v, mask, ragged), args.repeats, args.iters)
        row["pallas_ms"] = time_call(ker, (q, k, v, mask, ragged), args.repeats, args.iters)
        row["speedup"] = row["xla_ms"] / row["pallas_ms"]
        want, got = ref(q, k, v, mask, ragged)[0], ker(q, k, v, mask, ragged)[0]
        row["max_abs_err"] = float(jnp.max(jnp.abs(got - want)))
        row["tiling"] = dataclasses.asdict(tiling)
        old = previous_tiling(batch, t, h, kvh, d, cap)
        if args.previous_splits and old != tiling:
          ker_old = looped(lambda q, k, v, m, r: va.pallas_verify_attention(q, k, v, r, scale, tiling=old,
                                                                            interpret=interpret), args.iters)
          row["pallas_previous_splits_ms"] = time_call(ker_old, (q, k, v, mask, ragged), args.repeats, args.iters)
          row["previous_tiling"] = dataclasses.asdict(old)
        if args.split_candidates:
          row["candidates"] = []
          for cand in candidate_tilings(tiling, batch, kvh, cap):
            ker_c = looped(lambda q, k, v, m, r, c=cand: va.pallas_verify_attention(q, k, v, r, scale, tiling=c,
                                                                                   interpret=interpret), args.iters)
            row["candidates"].append({"block_k": cand.block_k, "n_splits": cand.n_splits,
                                      "ms": time_call(ker_c, (q, k, v, mask, ragged), args.repeats, args.iters)})
      except Exception as e:  # noqa: BLE001 - record and go on: one failing shape must not lose the rest
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
      rows.append(row)
      print({x: (round(y, 4) if isinstance(y, float) else y) for x, y in row.items() if x != "tiling"}, flush=True)
  return rows


def end_to_end(args, budget_s: float) -> dict:
  from specjax.bench.prompts import load_prompt_set
  from specjax.drafters.base import DraftParams
  from specjax.drafters.registry import make_speculator
  from specjax.engine import speculative_generate
  from specjax.models.load import load_model
  from specjax.engine.sampling import SamplingParams

  t_start = time.perf_counter()
  target = load_model(args.model, dtype=jnp.bfloat16, progress=False)
  tok = target.tokenizer
  questions = load_prompt_set("mt_bench", limit=args.questions)
  prompts = [tok.encode_chat([{"role": "user", "content": q.turns[0]}]) for q in questions]
  dp = DraftParams(n_max=args.n_max)
  drafter = make_speculator("ngram_simple", target, draft_params=dp)
  stop = tuple(tok.eos_ids)
  from specjax.kernels import accept_sample as asl
  switches = {"verify_attention": va.SWITCH, "accept_sample": asl.SWITCH}

  def generate(batch_prompts, max_new):
    sampling = SamplingParams.make(len(batch_prompts), temperature=0.0)
    return speculative_generate(target.params, target.cfg, batch_prompts, drafter, max_new_tokens=max_new,
                                sampling=sampling, draft_params=dp, stop_ids=stop, capacity=args.capacity)

  runs, outputs = [], {}
  base_name = args.e2e_settings[0]
  for batch in args.e2e_batch:                       # all settings per batch size, in the given order
    for impl in args.e2e_settings:
      kernels = {}
      for name, choice in SETTINGS[impl].items():
        if choice == "auto" and not on_gpu():
          choice = "pallas"                           # CPU smoke: force the (interpreted) kernel path
        switches[name].set_impl(choice)
        kernels[name] = choice or switches[name].current_impl()
      jax.clear_caches()                              # the choice is made at trace time: retrace
      row = {"impl": impl, "kernels": kernels, "batch": batch, "questions": len(prompts), "n_max": args.n_max,
             "capacity": args.capacity, "max_new_tokens": args.max_new}
      if time.perf_counter() - t_start > budget_s:
        runs.append({**row, "skipped": "time budget"})
        continue
      groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
      t0 = time.perf_counter()
      for g in groups:                                 # compile every shape (untimed): 2 new tokens
        generate(g, 2)
      row["warmup_s"] = time.perf_counter() - t0
      secs, n_tok, toks, taus = 0.0, 0, [], []
      for g in groups:
        r = generate(g, args.max_new)
        secs += r.seconds
        n_tok += r.n_generated
        toks += r.tokens
        taus.append(float(r.stats.tau))
      row.update(seconds=secs, new_tokens=n_tok, tokens_per_s=n_tok / secs, tau=statistics.mean(taus))
      outputs[(impl, batch)] = toks
      runs.append(row)
      print(row, flush=True)
  for sw in switches.values():
    sw.set_impl(None)
  for row in runs:
    if row["impl"] != base_name and (base_name, row["batch"]) in outputs and (row["impl"], row["batch"]) in outputs:
      a, b = outputs[(base_name, row["batch"])], outputs[(row["impl"], row["batch"])]
      row[f"equal_to_{base_name}"] = sum(x == y for x, y in zip(a, b)) / len(a)
      base = next(r for r in runs if r["impl"] == base_name and r["batch"] == row["batch"])
      row[f"speedup_vs_{base_name}"] = row["tokens_per_s"] / base["tokens_per_s"]
  probes = [{"kernel": name, "key": [str(x) for x in key], "kernel_ok": ok}
            for name, sw in switches.items() for key, ok in sw.probed.items()]
  return {"model": args.model, "speculator": "ngram_simple (device)", "settings": {n: SETTINGS[n] for n in args.e2e_settings},
          "runs": runs, "kernel_probes": probes}


def plot(result: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  micro_rows = [r for r in result.get("micro", []) if "speedup" in r]
  e2e = [r for r in result.get("end_to_end", {}).get("runs", []) if "tokens_per_s" in r]
  fig, axes = plt.subplots(1, len(MODELS) + 1, figsize=(6 * (len(MODELS) + 1), 4.5))
  for ax, model in zip(axes, MODELS):
    rows = [r for r in micro_rows if r["model"] == model]
    prev = [r for r in rows if "pallas_previous_splits_ms" in r]
    if prev:   # batch-1 runs: the previous split rule beside the new one
      rows = rows + [{**r, "batch": f"{r['batch']} (previous splits)",
                      "speedup": r["xla_ms"] / r["pallas_previous_splits_ms"]} for r in prev]
    labels = sorted({(r["context"], r["k"]) for r in rows})
    batches = sorted({r["batch"] for r in rows}, key=str)
    width = 0.8 / max(1, len(batches))
    for i, b in enumerate(batches):
      vals = [next((r["speedup"] for r in rows if r["batch"] == b and (r["context"], r["k"]) == lab), 0.0)
              for lab in labels]
      ax.bar(np.arange(len(labels)) + i * width, vals, width, label=f"batch {b}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.5, color="r", lw=0.8, ls="--", label="bar 1.5x")
    ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{c // 1024 if c >= 1024 else c}{'k' if c >= 1024 else ''}\nK={k}" for c, k in labels],
                       fontsize=7)
    ax.set_ylabel("XLA time / kernel time")
    ax.set_title(f"{model} heads {MODELS[model]}")
    ax.legend(fontsize=7)
  ax = axes[-1]
  if e2e:
    labels = [f"{r['impl']}\nbatch {r['batch']}" for r in e2e]
    names = list(dict.fromkeys(r["impl"] for r in e2e))
    ax.bar(range(len(e2e)), [r["tokens_per_s"] for r in e2e], color=[f"C{names.index(r['impl'])}" for r in e2e])
    ax.set_xticks(range(len(e2e)))
    ax.set_xticklabels(labels, fontsize=8)
  ax.set_ylabel("tokens/s")
  ax.set_title("SmolLM2 + ngram_simple, MT-bench (end to end)")
  fig.suptitle(f"verification attention, {result['device']['device_kind']} ({result['git_revision']})")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  smoke = os.environ.get("SMOKE") == "1"
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True)
  ap.add_argument("--models", nargs="+", default=list(MODELS) if not smoke else ["smollm2-135m"])
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32] if not smoke else [2])
  ap.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 16384] if not smoke else [200])
  ap.add_argument("--k", type=int, nargs="+", default=[0, 4, 8, 16] if not smoke else [4])
  ap.add_argument("--iters", type=int, default=20 if not smoke else 2)
  ap.add_argument("--repeats", type=int, default=5 if not smoke else 1)
  ap.add_argument("--micro-budget-s", type=float, default=210)
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--questions", type=int, default=16 if not smoke else 2)
  ap.add_argument("--e2e-batch", type=int, nargs="+", default=[1, 8] if not smoke else [1, 2])
  ap.add_argument("--n-max", type=int, default=8 if not smoke else 4)
  ap.add_argument("--capacity", type=int, default=4096 if not smoke else 256)
  ap.add_argument("--max-new", type=int, default=256 if not smoke else 8)
  ap.add_argument("--e2e-budget-s", type=float, default=200)
  ap.add_argument("--e2e-settings", nargs="+", default=["xla", "auto"], choices=list(SETTINGS),
                  help="kernel settings to compare end to end (the first is the baseline): " +
                       "; ".join(f"{n}: {v}" for n, v in SETTINGS.items()))
  ap.add_argument("--skip-e2e", action="store_true")
  ap.add_argument("--skip-micro", action="store_true")
  ap.add_argument("--previous-splits", action="store_true", help="also time the split rule before the batch-1 change")
  ap.add_argument("--split-candidates", action="store_true",
                  help="also time other split plans (block_k 64/128, several split counts) per shape")
  ap.add_argument("--tag", default="", help="file name part: verify_attention_<tag>_<card>.json")
  args = ap.parse_args(argv)
  out_dir = Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  dev = device_info()
  card = dev["device_kind"].lower().replace("nvidia ", "").replace(" ", "_")
  path = out_dir / f"verify_attention_{args.tag + '_' if args.tag else ''}{card}.json"
  result = {"experiment": "verify_attention", "config": vars(args), "smoke": smoke, "git_revision": git_revision(),
            "device": dev}

  def save():
    path.write_text(json.dumps(result, indent=1))
    plot(result, path.with_suffix(".png"))

  result["micro"] = [] if args.skip_micro else micro(args, args.micro_budget_s)
  save()
  if not args.skip_e2e:
    result["end_to_end"] = end_to_end(args, args.e2e_budget_s)
    save()
  ok = [r for r in result["micro"] if "speedup" in r and r["context"] >= 4096 and r["k"] > 0]
  if ok:
    print(f"context >= 4k, K > 0: kernel speedup min {min(r['speedup'] for r in ok):.2f}x, "
          f"median {statistics.median(r['speedup'] for r in ok):.2f}x over {len(ok)} shapes")
  prev = [r for r in result["micro"] if "pallas_previous_splits_ms" in r]
  if prev:
    print("new split rule / previous: " + ", ".join(
        f"b{r['batch']} {r['context']} K{r['k']} {r['model']}: {r['pallas_previous_splits_ms'] / r['pallas_ms']:.2f}x"
        for r in prev))
  print("wrote", path)


if __name__ == "__main__":
  main()
