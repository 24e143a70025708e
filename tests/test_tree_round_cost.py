"""experiments/tree_round_cost.py: ms per round from a bench result's rows, a batch's rows sharing
its seconds and running as many rounds as its longest row, and a tree's rounds over its chain's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import tree_round_cost  # noqa: E402


def _row(method, seconds, rounds, new_tokens=10):
  return {"method": method, "batch_seconds": seconds, "seconds": seconds / 2, "rounds": rounds,
          "new_tokens": new_tokens}


def test_round_costs_and_tree_over_chain(tmp_path):
  # batches of two prompts: (0.010 s, 5 / 4 rounds), (0.016 s, 8 / 6), (0.022 s, 11 / 3) for the chain;
  # the tree's batches take 1.5x as long per round: slope 3 ms, ratio 1.5
  chain = [_row("dflash_chain_8", s, r) for s, rs in ((0.010, (5, 4)), (0.016, (8, 6)), (0.022, (11, 3))) for r in rs]
  tree = [_row("dflash_tree_32", 1.5 * s, r) for s, rs in ((0.010, (5, 4)), (0.016, (8, 6)), (0.022, (11, 3)))
          for r in rs]
  plain = [_row("plain", 0.009, 0), _row("plain", 0.009, 0)]
  result = {"git_revision": "abc", "device": {"device_kind": "cpu"},
            "prompts": {"plain": plain, "dflash_chain_8": chain, "dflash_tree_32": tree}}
  path = tmp_path / "bench.json"
  path.write_text(json.dumps(result))
  costs = tree_round_cost.method_costs(result)
  assert costs["dflash_chain_8"]["ms_per_round"] == pytest.approx(1e3 * 0.048 / 24)
  assert costs["dflash_chain_8"]["ms_per_extra_round"] == pytest.approx(2.0)
  assert costs["dflash_chain_8"]["tau"] == pytest.approx(60 / 37) and costs["dflash_chain_8"]["batches"] == 3
  assert costs["plain"]["ms_per_round"] == pytest.approx(1.0) and costs["plain"]["batches"] == 1
  out = tmp_path / "summary.json"
  tree_round_cost.main([str(path), "--out", str(out)])
  summary = json.loads(out.read_text())[str(path)]
  assert summary["tree_over_chain_ms_per_round"] == {"dflash_tree_32 / dflash_chain_8": pytest.approx(1.5)}
