"""The adaptive controller's choices with and without shadow drafts, batch by batch, from a bench run of
configs/bench_adaptive_shadow_smollm2_b8.yaml (round costs fixed to a GPU's timed costs, so the choices
are those the controller makes there; the run itself may be on the CPU).

Per method and batch: rounds at each width, the rounds at the widest width after the first segment
(exploring segments, or that width chosen) and at any drafting width after it (chosen widths, and
trees' probes one budget above the choice), the batch's rounds, and the modeled time sum(rounds x cost(width)) at the method's
fixed costs against the batch's plain rounds at the same program's width-0 cost (`x_width0`: above 1
the controller's drafting paid at those costs, below it lost against backing off for every round).
Leaves out what the fixed costs leave out: a shadow draft's own cost per plain chunk (one full-width
draft per chunk of up to 32 steps) and the per-call costs. Writes JSON and a chart (all batches, per batch).

  python experiments/adaptive_shadow_summary.py RESULT.json --out SUMMARY.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def batches(rows: list[dict], batch_size: int) -> list[list[dict]]:
  """Rows grouped by batch, in the order the harness ran them."""
  return [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]


def batch_record(rows: list[dict]) -> dict | None:
  """The batch's adaptive record (the harness keeps it on the batch's first row)."""
  return next((r["adaptive"] for r in rows if r.get("adaptive")), None)


def widest_after_first(segments: list[list[int]], widest: int) -> int:
  """Rounds of segments at the widest width after the first segment."""
  return sum(n for w, n in segments[1:] if w == widest)


def summarize(d: dict) -> dict:
  bs = d["config"]["batch_size"]
  plain = batches(d["prompts"]["plain"], bs)
  out: dict = {"batch_size": bs, "git_revision": d.get("git_revision"), "device": d["device"].get("device_kind"),
               "methods": {}}
  for name, rows in d["prompts"].items():
    if name == "plain":
      continue
    per_batch, totals = [], defaultdict(float)
    for i, batch in enumerate(batches(rows, bs)):
      rec = batch_record(batch)
      if rec is None:
        continue
      costs = dict(zip(rec["widths"], rec["costs_ms"]))
      segs = rec["segments"]
      by_width: dict[int, int] = defaultdict(int)
      for w, n in segs:
        by_width[w] += n
      rounds = sum(by_width.values())
      plain_rounds = max(r["new_tokens"] for r in plain[i]) - 1     # the first token comes from the prefill
      model_ms = sum(n * costs[w] for w, n in segs)
      width0_ms = plain_rounds * costs[min(costs)]
      acc = sum(r["acc_tokens"] for r in batch)
      emitted = sum(r["emitted"] for r in batch)          # tokens the rounds emitted (the prefill's first not counted)
      row = {"batch": i, "categories": sorted({r["category"] for r in batch}), "rounds": rounds,
             "plain_rounds": plain_rounds, "rounds_by_width": {str(w): n for w, n in sorted(by_width.items())},
             "widest_after_first": widest_after_first(segs, max(costs)),
             "drafted_after_first": sum(n for w, n in segs[1:] if w > 0), "segments": segs,
             "model_ms": round(model_ms, 2), "width0_ms": round(width0_ms, 2),
             "x_width0": round(width0_ms / model_ms, 4), "tau": round(emitted / max(emitted - acc, 1), 3),
             "equal": sum(bool(r["equal_to_plain"]) for r in batch), "prompts": len(batch), "shadow": rec.get("shadow")}
      per_batch.append(row)
      for k in ("rounds", "plain_rounds", "widest_after_first", "drafted_after_first", "model_ms", "width0_ms", "equal", "prompts"):
        totals[k] += row[k]
    totals = dict(totals)
    totals["x_width0"] = round(totals["width0_ms"] / totals["model_ms"], 4) if totals.get("model_ms") else None
    out["methods"][name] = {"costs_ms": per_batch and batch_record(batches(rows, bs)[0])["costs_ms"],
                            "total": dict(totals), "batches": per_batch}
  return out


def plot(summary: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = list(summary["methods"])
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.0))
  vals = [summary["methods"][n]["total"].get("x_width0") or 0 for n in names]
  axes[0].bar(names, vals, color=["tab:orange" if n.endswith("_shadow") else "tab:blue" for n in names])
  axes[0].set_title("all batches: modeled time of always width 0 / the controller's", fontsize=9)
  axes[0].tick_params(axis="x", rotation=45)
  axes[0].axhline(1.0, color="gray", lw=0.8)
  colors = {}
  for n in names:
    base = n.rsplit("_", 1)[0]
    colors.setdefault(base, f"C{len(colors)}")
    bs = summary["methods"][n]["batches"]
    axes[1].plot([b["batch"] for b in bs], [b["x_width0"] for b in bs], marker="o", color=colors[base],
                 ls="-" if n.endswith("_shadow") else "--", label=n)
  axes[1].axhline(1.0, color="gray", lw=0.8)
  axes[1].set_xlabel("batch")
  axes[1].set_title("per batch (solid: shadow drafts, dashed: exploring segments)", fontsize=9)
  axes[1].legend(fontsize=7, ncol=2)
  fig.suptitle(f"adaptive drafting with / without shadow drafts, batch {summary['batch_size']}, fixed GPU round costs "
               f"(run on {summary['device']})", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("result")
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  summary = summarize(json.loads(Path(args.result).read_text()))
  summary["source"] = args.result
  Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
  plot(summary, Path(args.out).with_suffix(".png"))
  for name, m in summary["methods"].items():
    print(name, m["total"])
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
