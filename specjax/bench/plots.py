"""Plots of a benchmark result: acceptance by draft position, tau and speedup by category."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_result(result: dict, out_png: str | Path) -> Path:
  summary = result["summary"]
  methods = [m for m in summary if m != "plain"]
  cats = sorted({c for m in summary.values() for c in m["by_category"]})
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
  ax = axes[0]
  for m in methods:
    by_pos = summary[m]["overall"]["acceptance_by_pos"]
    if by_pos:
      ys = np.array([np.nan if a is None else a for a in by_pos], float)
      ax.plot(np.arange(1, len(ys) + 1), ys, marker="o", ms=3, label=m)
  ax.set(title="acceptance by draft position", xlabel="position", ylabel="P(accepted | drafted)", ylim=(0, 1.02))
  ax.legend(fontsize=8)
  width = 0.8 / max(len(methods), 1)
  x = np.arange(len(cats) + 1)
  labels = cats + ["overall"]
  for key, ax, base in (("tau", axes[1], 1.0), ("speedup", axes[2], 1.0)):
    for i, m in enumerate(methods):
      vals = [summary[m]["by_category"].get(c, {}).get(key) or 0.0 for c in cats] + [summary[m]["overall"][key] or 0.0]
      ax.bar(x + i * width - 0.4 + width / 2, vals, width, label=m)
    ax.axhline(base, color="k", lw=0.8, ls="--")
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set(title=f"{key} by category", ylabel=key)
    ax.legend(fontsize=8)
  dev = result.get("device", {}).get("device_kind", "")
  fig.suptitle(f"{result['experiment']} — target {result['config']['target']} on {dev} @ {result['git_revision'][:10]}")
  fig.tight_layout()
  out_png = Path(out_png)
  fig.savefig(out_png, dpi=110)
  plt.close(fig)
  return out_png
