"""experiments/invariant_equality.py's parallel run: the methods split over processes by their
first-prompt time with plain in the first, and the processes' result files merged (the union of
their runs, equality against plain recomputed across files, complete only when every prompt of
every method of every mode is in)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import invariant_equality as ie  # noqa: E402


def test_split_puts_plain_first_and_balances_compile_time():
  methods = ["plain", "ngram_simple", "mtp", "draft", "draft_tree", "suffix", "eagle3", "dflash"]
  groups = ie.split_methods(methods, 4)
  assert len(groups) == 4 and groups[0][0] == "plain"
  assert sorted(m for g in groups for m in g) == sorted(methods)
  assert {"draft", "draft_tree"} not in [set(g) & {"draft", "draft_tree"} for g in groups]   # the two slowest apart
  assert ie.split_methods(["plain", "mtp"], 4) == [["plain"], ["mtp"]]


def _result(methods, runs, complete=True):
  return {"experiment": "invariant_equality", "config": {"methods": methods}, "complete": complete,
          "self_check": {"invariant": {"all_bitwise": True}}, "runs": {"invariant": runs}}


def test_merge_unites_runs_and_compares_with_plain_across_files(tmp_path):
  row = lambda toks: {"tokens": toks, "n_tokens": len(toks), "seconds": 0.5, "equal": None}
  a = _result(["plain", "mtp"], {"plain": {"81": row([1, 2]), "82": row([3, 4])},
                                 "mtp": {"81": row([1, 2]), "82": row([3, 5])}})
  b = _result(["suffix"], {"suffix": {"81": row([1, 2]), "82": row([3, 4])}})
  pa, pb = tmp_path / "a.json", tmp_path / "b.json"
  pa.write_text(json.dumps(a))
  pb.write_text(json.dumps(b))
  merged = ie.merge([pa, pb], tmp_path / "m.json")
  s = merged["summary"]["invariant"]
  assert (s["mtp"]["n_equal"], s["mtp"]["n_compared"]) == (1, 2)
  assert (s["suffix"]["n_equal"], s["suffix"]["n_compared"]) == (2, 2)      # its plain was in the other file
  assert merged["config"]["methods"] == ["plain", "mtp", "suffix"] and merged["complete"]
  b["runs"]["invariant"]["suffix"].pop("82")
  pb.write_text(json.dumps(b))
  assert not ie.merge([pa, pb], tmp_path / "m.json")["complete"]
  assert json.loads((tmp_path / "m.json").read_text())["summary"]["invariant"]["suffix"]["prompts"] == 1
