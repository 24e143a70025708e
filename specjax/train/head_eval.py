"""Trained heads evaluated the way the bench harness measures (`specjax.bench.runner`): plain
decoding and each head's method on the first turns of the same questions, batch by batch, every
new input shape warmed up untimed, each batch timed `repeats` times (its fastest run counts).

`evaluate_rows` is the one loop behind `specjax train eval-mtp`, `eval-eagle3` and `eval-dflash`:
per temperature, a plain row, then one row per method with tau (tokens emitted per verification
round), acceptance by draft position (chains) or depth (trees), tau by category, tokens/s and the
speedup over plain decoding (tokens/s over tokens/s), and, greedy, the share of outputs equal to
plain decoding's. Each command maps these rows onto its own result format.
"""

from __future__ import annotations

import numpy as np

from specjax.bench.config import DraftParamsConfig, ExperimentConfig, MethodConfig, SamplingConfig
from specjax.bench.records import PLAIN, compare_with_plain, position_counts, summarize
from specjax.bench.runner import run_method
from specjax.drafters.base import DraftParams
from specjax.drafters.registry import make_speculator
from specjax.engine.generation import PROMPT_BUCKET, round_up


def head_method(target, label: str, speculator: str, head, n_max: int, options: dict | None = None) -> MethodConfig:
  """The harness's method for a head (a file, or a head in memory) under `label`, its drafter built
  once here (the registry's builder), so that every temperature's run reuses its compiled loops.
  n_max: a chain's length, a tree's depth cap (its node budget is the `n_nodes` option)."""
  drafter = make_speculator(speculator, target, head=head, draft_params=DraftParams(n_max=n_max),
                            options=dict(options or {}))
  return MethodConfig(name=label, speculator=drafter, draft_params=DraftParamsConfig(n_max=n_max))


def first_turn_capacity(target, questions, max_new_tokens: int, widest: int) -> int:
  """KV slots for the first turns of `questions` (chat-encoded), `max_new_tokens` and drafts of up
  to `widest` tokens."""
  longest = max(len(target.tokenizer.encode_chat([{"role": "user", "content": q.turns[0]}])) for q in questions)
  return round_up(round_up(longest, PROMPT_BUCKET) + max_new_tokens + widest + 2, 64)


def evaluate_rows(target, questions, methods: list[MethodConfig], *, temperatures=(0.0,), max_new_tokens: int = 128,
                  batch_size: int = 8, repeats: int = 1, seed: int = 0, capacity: int | None = None,
                  done_rows: list[dict] | None = None, on_row=None, progress: bool = True,
                  tag: str = "eval") -> list[dict]:
  """Rows (plain, then each method, per temperature) of the first turns of `questions`.
  `done_rows`: rows of an interrupted evaluation; a temperature they complete (plain and every
  method) is kept as it is. `on_row(rows so far)` after each row (and after a kept temperature)."""
  rows: list[dict] = []
  widest = max([max(m.draft_params.n_max, m.speculator.max_draft) for m in methods] + [1])   # trees: their nodes
  cap = capacity or first_turn_capacity(target, questions, max_new_tokens, widest)
  labels = [PLAIN] + [m.name for m in methods]
  for temp in temperatures:
    kept = {r["method"]: r for r in done_rows or [] if r.get("temperature") == temp}
    if set(labels) <= set(kept):
      rows.extend(kept[label] for label in labels)
      if on_row:
        on_row(rows)
      if progress:
        print(f"[{tag} T={temp}] kept from the interrupted run", flush=True)
      continue
    cfg = ExperimentConfig(name=tag, target=str(getattr(target, "name", "")), turns=1, max_new_tokens=max_new_tokens,
                           batch_size=batch_size, repeats=max(1, repeats), seed=seed, capacity=cap,
                           sampling=SamplingConfig(temperature=temp), methods=tuple(methods))
    plain = None
    for method in [None] + list(methods):
      records = run_method(cfg, target, method, questions, {})
      if method is None:
        plain = records
      row = _row(labels[0] if method is None else method, temp, records, plain)
      rows.append(row)
      if on_row:
        on_row(rows)
      if progress:
        print(f"[{tag} T={temp}] {_describe(row)}", flush=True)
  return rows


def _row(method, temp: float, records: list, plain: list) -> dict:
  """One method's row (method: a MethodConfig, or the plain label) from its harness records."""
  if not isinstance(method, MethodConfig):
    s = summarize(records, {})
    return {"method": method, "temperature": temp, "tokens": s["new_tokens"], "seconds": s["seconds"],
            "tokens_per_s": s["tokens_per_s"], "speedup": 1.0, "tau": 1.0, "repeat_spread": s["repeat_spread"]}
  by_plain = compare_with_plain({PLAIN: plain, method.name: records})
  s = summarize(records, by_plain)
  n_max = method.draft_params.n_max
  drafted, accepted = (x[:n_max] for x in position_counts(records))
  cats: dict[str, list] = {}
  for r in records:
    cats.setdefault(r.category, []).append(r)
  plain_tps = summarize(plain, {})["tokens_per_s"]
  row = {"method": method.name, "temperature": temp, "n_max": n_max, "tau": s["tau"],
         "rounds": sum(r.rounds for r in records), "tokens": s["new_tokens"], "seconds": s["seconds"],
         "acceptance_by_pos": (accepted / np.maximum(drafted, 1)).round(4).tolist(),
         "drafted_by_pos": drafted.tolist(), "tokens_per_s": s["tokens_per_s"],
         "speedup": s["tokens_per_s"] / plain_tps, "repeat_spread": s["repeat_spread"],
         "tau_by_category": {c: summarize(rs, by_plain)["tau"] for c, rs in sorted(cats.items())}}
  if temp == 0:
    row["equal_to_plain"] = s["equal"]
  return row


def _describe(row: dict) -> str:
  if row["method"] == PLAIN:
    return f"plain: {row['tokens_per_s']:.1f} tok/s"
  return (f"{row['method']}: tau {row['tau']:.3f}, {row['tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x), "
          f"acceptance {row['acceptance_by_pos'][:8]}"
          + (f", equal to plain {row['equal_to_plain']:.2f}" if "equal_to_plain" in row else ""))
