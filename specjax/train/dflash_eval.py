"""Evaluating a DFlash drafter: tau, acceptance by draft position and tokens/s against plain decoding
(and other trained drafters, e.g. an MTP head) on the first turns of a prompt set, greedy and
sampled, every method in the same process on the same batches, measured by the bench harness
(`specjax.train.head_eval`: every new batch shape warmed up untimed, the fastest of `repeats` runs of
each batch counts, every row gives the spread over repeats). Greedy runs also report the share of
sequences equal to plain decoding's (1.0 = lossless in practice; bf16 verification of K+1 tokens may
round a near-tie differently from one-token decoding). A resumed evaluation keeps every temperature
whose rows (plain and every method) an interrupted run completed, and runs the others.
"""

from __future__ import annotations

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
  """methods: {label: (speculator name, head path or head in memory, n_max, options)}, each made by the
  registry (a tree's n_max caps its depth; its node budget is the `n_nodes` option). `capacity`: KV
  slots (default: enough for these prompts); one capacity for several prompt sets lets their runs
  share compiled decode loops. `on_row(result so far)` is called after each row (a caller can save
  partial results of a long run). `repeats`: each batch is timed that many times and its fastest run
  counts. `done_rows`: the rows of an interrupted evaluation of these questions: a temperature they
  complete (plain and every method) is kept as it is and not run again."""
  from specjax.bench.prompts import load_prompt_set
  from specjax.train.head_eval import evaluate_rows, first_turn_capacity, head_method

  questions = load_prompt_set(prompt_set, limit=n_questions)
  configs = [head_method(target, label, name, head, n_max, {name: dict(opts or {})})
             for label, (name, head, n_max, opts) in methods.items()]
  widest = max([c.speculator.max_draft for c in configs] + [1])                    # trees: their node budgets
  cap = capacity or first_turn_capacity(target, questions, max_new_tokens, widest)
  result = {"prompt_set": prompt_set, "questions": [q.question_id for q in questions],
            "max_new_tokens": max_new_tokens, "batch_size": batch_size, "capacity": cap,
            "methods": {k: list(v[:3]) + [dict(v[3] or {})] for k, v in methods.items()},
            "repeats": max(1, repeats), "rows": []}

  def saved(rows):
    result["rows"] = rows
    if on_row:
      on_row(result)

  result["rows"] = evaluate_rows(target, questions, configs, temperatures=temperatures, max_new_tokens=max_new_tokens,
                                 batch_size=batch_size, repeats=repeats, seed=seed, capacity=cap, done_rows=done_rows,
                                 on_row=saved, progress=progress, tag=f"eval {prompt_set}")
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
