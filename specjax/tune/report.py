"""Reading a tune report: the trials table in Markdown and the three-panel trials figure."""

from __future__ import annotations

import math
from pathlib import Path


def _num(x) -> float:
  return -math.inf if x is None else float(x)


def _fmt(x, spec=".2f") -> str:
  return "-" if x is None else format(x, spec)


def trials_markdown(report: dict) -> str:
  m = report["metric"]
  lines = [f"# spec-tune: {report['experiment']}", "",
           f"- strategy **{report['strategy']}**, seed {report['seed']}, budget {report['budget']}, "
           f"stopped by: {report['stop_reason']}; rungs (questions): {report['rungs']}",
           f"- {len(report['trials'])} trials in {report['search_seconds']:.1f} s on "
           f"{report['device'].get('device_kind', '?')} @ {report['git_revision'][:12]}",
           f"- tuning questions: {len(report['tune_questions'])}, held out: {len(report['holdout_questions'])}",
           f"- plain decoding on the tuning questions: "
           f"{_fmt((report['plain'] or {}).get('tokens_per_s'), '.1f')} tok/s",
           f"- **best: trial {report['best']}** `{report['trials'][report['best']]['label']}` "
           f"({m} {_fmt(report['trials'][report['best']]['metric'], '.3f')})",
           f"- default: `{report['default']['label']}`", ""]
  hs = _holdout_overall(report)
  lines += ["## Held-out questions (never seen by the search)", "",
            "| method | config | prompts | tau | acceptance | tok/s | speedup | equal |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
  labels = {report["default"]["name"]: report["default"]["label"],
            report["best_method"]["name"]: report["trials"][report["best"]]["label"], "plain": "-"}
  for name, o in hs.items():
    lines.append(f"| {name} | `{labels.get(name, '')}` | {o['prompts']} | {_fmt(o['tau'], '.3f')} | "
                 f"{_fmt(o['acceptance_rate'], '.3f')} | {_fmt(o['tokens_per_s'], '.1f')} | "
                 f"{_fmt(o['speedup'], '.3f')} | {_fmt(o['equal'], '.2f')} |")
  lines += ["", "## Trials (sorted: most questions first, then by the metric)", "",
            f"| rank | trial | config | status | questions | {m} | tok/s | speedup | tau | acceptance | wall s |",
            "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  rows = sorted(report["trials"], key=lambda r: (-r["n_questions"], -_num(r["metric"]), r["index"]))
  for rank, r in enumerate(rows, 1):
    st = r["status"] + (f" ({r['error']})" if r["error"] else "")
    lines.append(f"| {rank} | {r['index']} | `{r['label']}` | {st} | {r['n_questions']} | "
                 f"{_fmt(r['metric'], '.3f')} | {_fmt(r.get('tokens_per_s'), '.1f')} | "
                 f"{_fmt(r.get('speedup'), '.3f')} | {_fmt(r.get('tau'), '.3f')} | "
                 f"{_fmt(r.get('acceptance_rate'), '.3f')} | {r['wall_seconds']:.1f} |")
  return "\n".join(lines) + "\n"


def _arm(r: dict) -> str:
  return f"chain_{r['method']['policy']}" if r["chain"] else r["speculator"]


def _holdout_overall(report: dict) -> dict:
  if "holdout" in report:
    return {n: s["overall"] for n, s in report["holdout"]["summary"].items()}
  return report["holdout_summary"]


def plot_tune(report: dict, out_png: str | Path | None = None):
  """Three panels: every trial's metric at each rung it reached (bigger = more questions; black:
  best so far among trials on all tuning questions), the first rung's metric (every trial on the
  same questions) against n_max, and plain / default / tuned on the held-out questions. Saves to
  `out_png` and returns its path, or returns the figure when `out_png` is None."""
  import matplotlib
  if out_png is not None:
    matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  m = report["metric"]
  trials = [r for r in report["trials"] if r["rungs"]]
  arms = sorted({_arm(r) for r in trials})
  colors = {a: plt.cm.tab10(i % 10) for i, a in enumerate(arms)}
  top = max((r["n_questions"] for r in trials), default=1)
  fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
  ax = axes[0]
  for a in arms:
    first = True
    for r in (r for r in trials if _arm(r) == a):
      ys = [g[m] for g in r["rungs"]]
      ax.plot([r["index"]] * len(ys), ys, color=colors[a], lw=0.8, alpha=0.6)
      ax.scatter([r["index"]] * len(ys), ys, s=[15 + 85 * g["n_questions"] / top for g in r["rungs"]],
                 color=colors[a], alpha=0.85, label=a if first else None)
      first = False
  best_so_far, xs, ys = -math.inf, [], []
  for r in sorted(trials, key=lambda r: r["index"]):
    if r["n_questions"] == top and r["metric"] is not None:
      best_so_far = max(best_so_far, r["metric"])
      xs.append(r["index"])
      ys.append(best_so_far)
  if xs:
    ax.step(xs + [max(r["index"] for r in trials)], ys + ys[-1:], where="post", color="k", lw=1,
            label=f"best so far ({top} questions)")
  if report.get("plain") and m != "speedup":
    ax.axhline(report["plain"][m], color="gray", ls="--", lw=0.8, label="plain (all tuning questions)")
  if m == "speedup":
    ax.axhline(1.0, color="gray", ls="--", lw=0.8)
  b = report["trials"][report["best"]]
  ax.scatter([b["index"]], [b["metric"]], marker="*", s=280, color="gold", edgecolor="k", zorder=5, label="best")
  ax.set(title=f"trials ({report['strategy']}, seed {report['seed']}; rungs {report['rungs']} questions)",
         xlabel="trial", ylabel=m)
  ax.legend(fontsize=7)
  ax = axes[1]
  n0 = min(r["rungs"][0]["n_questions"] for r in trials) if trials else 0
  for a in arms:
    rs = [r for r in trials if _arm(r) == a and r["rungs"][0]["n_questions"] == n0]
    ax.scatter([r["method"]["draft_params"]["n_max"] for r in rs], [r["rungs"][0][m] for r in rs],
               color=colors[a], label=a, alpha=0.85)
  ax.set_xscale("log", base=2)
  ax.set(title=f"{m} vs n_max (first rung: every trial on the same {n0} questions)", xlabel="n_max", ylabel=m)
  ax = axes[2]
  hs = _holdout_overall(report)
  names = list(hs)
  bars = ax.bar(names, [hs[n]["tokens_per_s"] for n in names], color=["gray", "tab:blue", "tab:orange"][:len(names)])
  for bar_, n in zip(bars, names):
    sp = hs[n]["speedup"]
    ax.annotate(f"{bar_.get_height():.1f}" + (f"\n{sp:.2f}x" if sp is not None else ""),
                (bar_.get_x() + bar_.get_width() / 2, bar_.get_height()), ha="center", va="bottom", fontsize=8)
  ax.set(title=f"held-out ({len(report['holdout_questions'])} questions the search never saw)", ylabel="tokens/s")
  ax.margins(y=0.15)
  dev = report.get("device", {}).get("device_kind", "")
  fig.suptitle(f"spec-tune {report['experiment']} — {report['config']['target']} on {dev} "
               f"@ {report['git_revision'][:10]}")
  fig.tight_layout()
  if out_png is None:
    return fig
  out_png = Path(out_png)
  fig.savefig(out_png, dpi=110)
  plt.close(fig)
  return out_png
