"""Evaluating a DFlash drafter: tau, acceptance by draft position and tokens/s against plain decoding
(and other trained drafters, e.g. an MTP head) on the first turns of a prompt set, greedy and
sampled, every method in the same process on the same batches.

Every configuration first runs untimed once per batch shape (batch size and padded prompt width:
compilation), then timed on every batch (the fastest of `repeats` runs counts; every row also gives
the spread over repeats); greedy runs also report the share of sequences equal to plain decoding's
(1.0 = lossless in practice; bf16 verification of K+1 tokens may round a near-tie differently from
one-token decoding). A resumed evaluation keeps every temperature whose rows (plain and every
method) an interrupted run completed, and runs the others.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def first_turns(target, prompt_set: str, n_questions: int) -> tuple[list, list[list[int]]]:
  from specjax.bench.prompts import load_prompt_set
  questions = load_prompt_set(prompt_set, limit=n_questions)
  tok = target.tokenizer
  return questions, [tok.encode_chat([{"role": "user", "content": q.turns[0]}]) for q in questions]


def evaluate(target, methods: dict, *, prompt_set: str = "mt_bench", n_questions: int = 16,
             temperatures=(0.0, 0.7), max_new_tokens: int = 128, batch_size: int = 8, seed: int = 0,
             capacity: int | None = None, progress: bool = True, on_row=None, repeats: int = 1,
             done_rows: list[dict] | None = None) -> dict:
  """methods: {label: (speculator name, head path, n_max, options)}, each made by the registry.
  `capacity`: KV slots (default: enough for these prompts); one capacity for several prompt sets
  lets their runs share compiled decode loops. `on_row(result so far)` is called after each row
  (a caller can save partial results of a long run). `repeats`: each batch is timed that many
  times and its fastest run counts (short batch-1 runs on a GPU vary by several percent).
  `done_rows`: the rows of an interrupted evaluation of these questions: a temperature they
  complete (plain and every method) is kept as it is and not run again."""
  from specjax.bench.harness import repeat_spread
  from specjax.engine.decode import generate_plain
  from specjax.drafters.base import DraftParams
  from specjax.drafters.registry import make_speculator
  from specjax.engine import speculative_generate
  from specjax.engine.generation import PROMPT_BUCKET, round_up
  from specjax.engine.sampling import SamplingParams

  questions, prompts = first_turns(target, prompt_set, n_questions)
  stop = tuple(target.tokenizer.eos_ids)
  batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
  widest = max([m[2] for m in methods.values()] + [1])
  cap = capacity or round_up(round_up(max(len(p) for p in prompts), PROMPT_BUCKET) + max_new_tokens + widest + 2, 64)
  params, cfg = target.params, target.cfg

  def sampling(n, temp):
    return SamplingParams.make(n, temperature=temp, seed=[seed + i for i in range(n)])

  warmed = set()

  def timed(fn, label):
    for chunk in batches:          # compile / warm up once per method and batch shape
      shape = (label, len(chunk), round_up(max(len(p) for p in chunk), PROMPT_BUCKET))
      if shape not in warmed:
        fn(chunk)
        warmed.add(shape)
    outs, secs = [], 0.0
    by_repeat = [0.0] * max(1, repeats)
    for chunk in batches:          # the fastest of `repeats` runs of each batch (same tokens each time)
      best = float("inf")
      for k in range(max(1, repeats)):
        t0 = time.perf_counter()
        r = fn(chunk)
        dt = time.perf_counter() - t0
        best = min(best, dt)
        by_repeat[k] += dt
      secs += best
      outs.append(r)
    return outs, secs, by_repeat

  drafters = {label: (make_speculator(name, target, head=head, draft_params=DraftParams(n_max=n_max),
                                      options={name: dict(opts or {})}), n_max)
              for label, (name, head, n_max, opts) in methods.items()}
  rows = []
  result = {"prompt_set": prompt_set, "questions": [q.question_id for q in questions],
            "max_new_tokens": max_new_tokens, "batch_size": batch_size, "capacity": cap,
            "methods": {k: list(v[:3]) + [dict(v[3] or {})] for k, v in methods.items()},
            "repeats": max(1, repeats), "rows": rows}
  for temp in temperatures:
    kept = [r for r in done_rows or [] if r.get("temperature") == temp]
    if {"plain", *methods} <= {r["method"] for r in kept}:
      rows.extend(next(r for r in kept if r["method"] == label) for label in ["plain", *methods])
      if on_row:
        on_row(result)
      if progress:
        print(f"[eval {prompt_set} T={temp}] kept from the interrupted run", flush=True)
      continue
    plain, plain_s, plain_reps = timed(
        lambda c: generate_plain(params, cfg, c, max_new_tokens=max_new_tokens, sampling=sampling(len(c), temp),
                                 stop_ids=stop, capacity=cap), "plain")
    plain_tokens = [t for r in plain for t in r.tokens]
    n_plain = sum(len(t) for t in plain_tokens)
    rows.append({"method": "plain", "temperature": temp, "tokens": n_plain, "seconds": plain_s,
                 "tokens_per_s": n_plain / plain_s, "speedup": 1.0, "tau": 1.0,
                 "repeat_spread": repeat_spread(n_plain, plain_reps)})
    if on_row:
      on_row(result)
    if progress:
      print(f"[eval {prompt_set} T={temp}] plain: {n_plain / plain_s:.1f} tok/s", flush=True)
    for label, (drafter, n_max) in drafters.items():
      dp = DraftParams(n_max=n_max)
      outs, secs, reps = timed(lambda c: speculative_generate(params, cfg, c, drafter, max_new_tokens=max_new_tokens,
                                                              sampling=sampling(len(c), temp), draft_params=dp,
                                                              stop_ids=stop, capacity=cap), label)
      toks = [t for r in outs for t in r.tokens]
      rounds = sum(r.stats.rounds for r in outs)
      emitted = sum(r.stats.emitted for r in outs)
      drafted = np.sum([r.stats.drafted_by_pos[:n_max] for r in outs], axis=0)
      accepted = np.sum([r.stats.accepted_by_pos[:n_max] for r in outs], axis=0)
      n_tok = sum(len(t) for t in toks)
      row = {"method": label, "temperature": temp, "n_max": n_max, "tau": emitted / max(rounds, 1),
             "rounds": rounds, "tokens": n_tok, "seconds": secs,
             "acceptance_by_pos": (accepted / np.maximum(drafted, 1)).round(4).tolist(),
             "tokens_per_s": n_tok / secs, "speedup": (n_tok / secs) / (n_plain / plain_s),
             "repeat_spread": repeat_spread(n_tok, reps)}
      if temp == 0:
        row["equal_to_plain"] = sum(a == p for a, p in zip(toks, plain_tokens)) / len(toks)
      rows.append(row)
      if on_row:
        on_row(result)
      if progress:
        print(f"[eval {prompt_set} T={temp}] {label}: tau {row['tau']:.3f}, {row['tokens_per_s']:.1f} tok/s "
              f"({row['speedup']:.2f}x), acceptance {row['acceptance_by_pos'][:8]}"
              + (f", equal to plain {row['equal_to_plain']:.2f}" if temp == 0 else ""), flush=True)
  return result


def format_eval(results: list[dict]) -> str:
  """One line per prompt set, temperature and method: tau, tokens/s, speedup, acceptance by
  position, equality with plain decoding."""
  return "\n".join(
      f"{r['prompt_set']:10s} T={row['temperature']:.1f} {row['method']:10s} tau {row.get('tau', 1.0):.2f} "
      f"{row['tokens_per_s']:8.1f} tok/s {row.get('speedup', 1.0):.2f}x "
      f"acc {row.get('acceptance_by_pos', [])[:6]} equal {row.get('equal_to_plain', '-')}"
      for r in results for row in r["rows"])


def plot_eval(results: list[dict], out_png: str | Path, title: str = "") -> Path:
  """Per prompt set and temperature: acceptance by draft position of each method, and tau /
  speedup over plain decoding as bars."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  panels = [(res, t) for res in results for t in sorted({r["temperature"] for r in res["rows"]})]
  fig, axes = plt.subplots(2, len(panels), figsize=(4.5 * len(panels), 7.5), squeeze=False)
  for col, (res, temp) in enumerate(panels):
    rows = [r for r in res["rows"] if r["temperature"] == temp]
    ax = axes[0, col]
    for r in rows:
      if "acceptance_by_pos" in r:
        acc = r["acceptance_by_pos"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", ms=3, label=f"{r['method']} (tau {r['tau']:.2f})")
    ax.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1), title=f"{res['prompt_set']}, T={temp}")
    ax.legend(fontsize=8)
    ax = axes[1, col]
    names = [r["method"] for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["tau"] for r in rows], 0.4, label="tau")
    ax.bar(x + 0.2, [r["speedup"] for r in rows], 0.4, label="speedup vs plain")
    ax.set_xticks(x, names, fontsize=8, rotation=30, ha="right")
    for i, r in enumerate(rows):
      ax.text(i + 0.2, r["speedup"], f"{r['tokens_per_s']:.0f}/s", ha="center", va="bottom", fontsize=7)
    ax.legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(out_png, dpi=110)
  plt.close(fig)
  return Path(out_png)
