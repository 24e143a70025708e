"""A tune run on disk: `write_outputs` writes best.yaml, trials.{json,md,png}, holdout.{json,png} and
the prompt JSONL files; `load_tune_run` reads a run back."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from specjax.tune.config import _plain
from specjax.tune.questions import write_questions
from specjax.tune.report import _fmt, plot_tune, trials_markdown


def best_config(report: dict, holdout_prompts: str | None = None) -> dict:
  """A bench config (dict) comparing plain, the default and the tuned method; on the held-out
  questions when their JSONL path is given, else on the tune config's prompt sets."""
  cfg = {k: v for k, v in report["config"].items() if k != "tune"}
  cfg["name"] = f"{report['experiment']}_best"
  if holdout_prompts is not None:
    cfg.update(prompts=[holdout_prompts], limit=None, categories=[])
  cfg["methods"] = [report["default"]["method"], report["best_method"]]
  return _plain(cfg)


def load_tune_run(out_dir: str | Path) -> dict:
  """A run written by `write_outputs`: trials.json with the full held-out result under "holdout"."""
  out = Path(out_dir)
  report = json.loads((out / "trials.json").read_text())
  if (out / "holdout.json").exists():
    report["holdout"] = json.loads((out / "holdout.json").read_text())
  return report


def write_outputs(report: dict, out_dir: str | Path) -> dict[str, Path]:
  """best.yaml, trials.{json,md,png}, holdout.{json,png}, tune/holdout prompt JSONL; returns paths."""
  from specjax.bench.plots import plot_result
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  paths = {}
  tune_qs, holdout_qs = report.get("_questions", (None, None))
  if holdout_qs is not None:
    paths["tune_prompts"] = write_questions(tune_qs, out / "tune_prompts.jsonl")
    paths["holdout_prompts"] = write_questions(holdout_qs, out / "holdout_prompts.jsonl")
  data = {k: v for k, v in report.items() if not k.startswith("_")}
  paths["holdout"] = out / "holdout.json"
  paths["holdout"].write_text(json.dumps(data["holdout"], indent=1))
  paths["holdout_png"] = plot_result(data["holdout"], out / "holdout.png")
  paths["trials"] = out / "trials.json"
  paths["trials"].write_text(json.dumps({k: v for k, v in data.items() if k != "holdout"}
                                        | {"holdout_summary": {n: s["overall"] for n, s in
                                                               data["holdout"]["summary"].items()}},
                                        indent=1))
  paths["trials_md"] = out / "trials.md"
  paths["trials_md"].write_text(trials_markdown(data))
  paths["trials_png"] = plot_tune(data, out / "trials.png")
  best = best_config(data, str(paths["holdout_prompts"]) if "holdout_prompts" in paths else None)
  b = data["trials"][data["best"]]
  header = (f"# spec-tune {data['experiment']}: trial {b['index']} of {len(data['trials'])} "
            f"({data['strategy']}, seed {data['seed']}), {data['metric']} {_fmt(b['metric'], '.3f')} "
            f"on {b['n_questions']} tuning questions\n"
            f"# on {data['device'].get('device_kind', '?')} @ {data['git_revision'][:12]}. Plain vs default vs tuned "
            f"on the held-out questions:\n#   specjax bench --config {out / 'best.yaml'}\n")
  paths["best"] = out / "best.yaml"
  paths["best"].write_text(header + yaml.safe_dump(best, sort_keys=False))
  return paths
