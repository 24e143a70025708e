"""`base:` in YAML configs (specjax/io/yaml_config.py): a config names another (relative to its own
folder) whose mapping it is merged over, nested mappings key by key, lists and other values replaced;
bench and tune configs load through it like training specs; loops and missing bases are refused.
Pure: no model is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from specjax.bench.config import ConfigError, load_config as load_bench_config
from specjax.io.yaml_config import load_config, merged

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_merged_is_a_deep_merge_that_replaces_lists():
  base = {"a": 1, "m": {"x": 1, "y": [1, 2], "n": {"p": 1}}, "l": [1]}
  over = {"m": {"y": [3], "n": {"q": 2}}, "l": [2, 3], "b": 2}
  assert merged(base, over) == {"a": 1, "b": 2, "l": [2, 3], "m": {"x": 1, "y": [3], "n": {"p": 1, "q": 2}}}
  assert base["m"]["n"] == {"p": 1}                       # the base is not changed


def test_a_chain_resolves_relative_to_each_file(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "root.yaml").write_text("name: r\nx: {a: 1, b: 2}\nl: [1, 2]\n")
  (tmp_path / "sub" / "mid.yaml").write_text("base: ../root.yaml\nname: m\nx: {b: 3}\n")
  (tmp_path / "child.yaml").write_text("base: sub/mid.yaml\nl: [9]\n")
  assert load_config(tmp_path / "child.yaml") == {"name": "m", "x": {"a": 1, "b": 3}, "l": [9]}
  (tmp_path / "plain.yaml").write_text("- 1\n- 2\n")
  assert load_config(tmp_path / "plain.yaml") == [1, 2]   # not a mapping: returned for the caller to name


def test_loops_and_missing_bases_are_refused(tmp_path):
  (tmp_path / "a.yaml").write_text("base: b.yaml\nname: a\n")
  (tmp_path / "b.yaml").write_text("base: a.yaml\nname: b\n")
  with pytest.raises(ConfigError, match=r"b\.yaml: `base:` chain loops back to a\.yaml"):
    load_config(tmp_path / "a.yaml")
  (tmp_path / "orphan.yaml").write_text("base: gone.yaml\nname: o\n")
  with pytest.raises(ConfigError, match=r"orphan\.yaml: base spec .*gone\.yaml does not exist"):
    load_config(tmp_path / "orphan.yaml")
  (tmp_path / "bad.yaml").write_text("base: [unclosed\n")
  with pytest.raises(ConfigError, match="not valid YAML"):
    load_config(tmp_path / "bad.yaml")


def test_bench_and_tune_configs_take_a_base(tmp_path):
  """A bench config of two lines over a committed one equals it except the keys it sets; a tune
  config likewise."""
  from specjax.tune.config import load_tune_config
  (tmp_path / "b.yaml").write_text(f"base: {CONFIGS / 'bench_smoke_smollm2.yaml'}\nname: other\nlimit: 1\n")
  base, child = load_bench_config(CONFIGS / "bench_smoke_smollm2.yaml"), load_bench_config(tmp_path / "b.yaml")
  assert (child.name, child.limit) == ("other", 1)
  assert child.methods == base.methods and child.target == base.target
  (tmp_path / "t.yaml").write_text(f"base: {CONFIGS / 'tune_smollm2_mt_bench.yaml'}\ntune: {{seed: 7}}\n")
  tbase, tchild = load_tune_config(CONFIGS / "tune_smollm2_mt_bench.yaml"), load_tune_config(tmp_path / "t.yaml")
  assert tchild.tune.seed == 7 and tchild.experiment == tbase.experiment
