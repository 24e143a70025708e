"""Training specs that change a base spec (`base:` in specjax/train/spec.py): `merged` merges nested
mappings key by key and replaces lists and other values; a chain of spec files loads with each
file's changes applied over its base's (the base path relative to the file's own folder); loops and
missing bases are refused; the second-round GPU spec equals its base except the fields it changes.
Pure: no model is loaded."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from specjax.bench.config import ConfigError
from specjax.train import dflash
from specjax.train.spec import merged, read_spec_yaml

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# the shape of configs/train_dflash_smollm2_gpu_step2_smoke.yaml, smaller
BASE_SPEC = """\
name: base_spec
target: smollm2-135m-instruct
dtype: float32
out_dir: out/base_spec
wall_budget_s: 240
data_budget_s: 60
held_out:
  - {name: humaneval, first: 16}
data:
  dir: out/base_spec/data
  sources: [{name: magpie, limit: 8, query_temperature: 1.0, query_top_p: 0.95, max_query_tokens: 48},
            {name: alpaca}, {name: gsm8k, limit: 4}]
  n_sequences: 16
  max_prompt_len: 128
  max_new_tokens: 24
  batch_size: 8
  store_taps: false
  seed: 0
extra_data:
  - {dir: out/base_spec/data_t08, sources: [{name: alpaca}, {name: humaneval}], n_sequences: 8,
     max_prompt_len: 128, max_new_tokens: 24, batch_size: 8, temperature: 0.8, store_taps: false, seed: 11}
heldout_data:
  - {dir: out/base_spec/heldout, sources: [{name: magpie, limit: 4, max_query_tokens: 48,
     query_prefixes: ["", "Write a"]}], n_sequences: 4, max_prompt_len: 128, max_new_tokens: 24,
     batch_size: 4, store_taps: false, seed: 99}
drafter:
  n_taps: 5
  n_layers: 3
  block_size: 16
  window: 256
  ffn_dim: 1024
loss:
  anchors_per_row: 4
  batch_size: 2
train:
  steps: 40
  lr: 1.5e-3
  warmup_steps: 5
  seed: 0
"""


def test_merged_merges_mappings_key_by_key_and_replaces_everything_else():
  """merged(base, over): keys only in `base` are kept, keys only in `over` added; a mapping over a
  mapping is merged recursively (at any depth); a list replaces a list whole (no element-wise
  merge, even of lists of mappings); a scalar, None or list over a mapping replaces it, and a
  mapping over a scalar replaces it; neither argument is modified."""
  base = {"name": "a", "keep": 1, "drafter": {"n_layers": 3, "window": 256, "deep": {"x": 1, "y": 2}},
          "data": {"sources": [{"name": "magpie", "limit": 8}, {"name": "alpaca"}], "seed": 0},
          "extra": [1, 2, 3], "sect": {"k": 1}, "scalar": 5, "gone": {"k": 1}}
  over = {"name": "b", "new": [0], "drafter": {"n_layers": 4, "deep": {"y": 3, "z": 4}},
          "data": {"sources": [{"name": "gsm8k"}]}, "extra": [], "sect": 7, "scalar": {"k": 2}, "gone": None}
  base0, over0 = copy.deepcopy(base), copy.deepcopy(over)
  out = merged(base, over)
  assert out == {"name": "b", "keep": 1, "new": [0],
                 "drafter": {"n_layers": 4, "window": 256, "deep": {"x": 1, "y": 3, "z": 4}},
                 "data": {"sources": [{"name": "gsm8k"}], "seed": 0},
                 "extra": [], "sect": 7, "scalar": {"k": 2}, "gone": None}
  assert base == base0 and over == over0
  assert merged(base, {}) == base and merged({}, over) == over


def test_base_chain_loads_with_each_files_changes(tmp_path):
  """A two-level chain (sub/child.yaml -> ../mid.yaml -> base.yaml, each base path relative to its
  file's folder) loads through dflash.load_spec as the base spec with mid's changes (name,
  drafter.n_layers, a replaced extra_data list) and child's (name again, train.lr) applied: every
  other field, the data lists and the other fields of `drafter` and `train` included, is the
  base's; command-line overrides still apply on top; the `base` key reaches no dataclass."""
  (tmp_path / "base.yaml").write_text(BASE_SPEC)
  (tmp_path / "mid.yaml").write_text("base: base.yaml\nname: mid_spec\ndrafter:\n  n_layers: 4\nextra_data: []\n")
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "child.yaml").write_text("base: ../mid.yaml\nname: child_spec\ntrain:\n  lr: 5.0e-4\n")

  base = dflash.load_spec(tmp_path / "base.yaml")
  mid = dflash.load_spec(tmp_path / "mid.yaml")
  child = dflash.load_spec(tmp_path / "sub" / "child.yaml")
  assert base.name == "base_spec" and base.drafter.n_layers == 3 and base.train.lr == 1.5e-3
  assert len(base.extra_data) == 1 and base.heldout_data[0].sources[0].query_prefixes == ("", "Write a")

  assert mid == dataclasses.replace(base, name="mid_spec", extra_data=(),
                                    drafter=dataclasses.replace(base.drafter, n_layers=4))
  assert child == dataclasses.replace(mid, name="child_spec", train=dataclasses.replace(mid.train, lr=5.0e-4))
  assert (child.data, child.heldout_data, child.held_out) == (base.data, base.heldout_data, base.held_out)
  assert child.drafter.ffn_dim == 1024 and child.train.steps == 40 and child.train.warmup_steps == 5

  over = dflash.load_spec(tmp_path / "sub" / "child.yaml", **{"train.steps": 3, "name": "cli", "dtype": None})
  assert over == dataclasses.replace(child, name="cli", train=dataclasses.replace(child.train, steps=3))
  assert "base" not in read_spec_yaml(tmp_path / "sub" / "child.yaml")


def test_base_loops_and_missing_bases_are_refused(tmp_path):
  """a.yaml with base b.yaml and b.yaml with base a.yaml: ConfigError naming the loop (from
  either end); a spec that is its own base likewise; a base file that does not exist: ConfigError
  naming the missing path."""
  (tmp_path / "a.yaml").write_text("base: b.yaml\nname: a\n")
  (tmp_path / "b.yaml").write_text("base: a.yaml\nname: b\n")
  with pytest.raises(ConfigError, match=r"b\.yaml: `base:` chain loops back to a\.yaml"):
    dflash.load_spec(tmp_path / "a.yaml")
  with pytest.raises(ConfigError, match=r"a\.yaml: `base:` chain loops back to b\.yaml"):
    dflash.load_spec(tmp_path / "b.yaml")
  (tmp_path / "self.yaml").write_text("base: ./self.yaml\nname: s\n")
  with pytest.raises(ConfigError, match="loops back to self.yaml"):
    dflash.load_spec(tmp_path / "self.yaml")
  (tmp_path / "orphan.yaml").write_text("base: nowhere/gone.yaml\nname: o\n")
  with pytest.raises(ConfigError, match=r"orphan\.yaml: base spec .*gone\.yaml does not exist"):
    dflash.load_spec(tmp_path / "orphan.yaml")


def test_gpu4b_is_gpu4_except_the_fields_it_changes():
  """configs/train_dflash_smollm2_gpu_step5.yaml (base: train_dflash_smollm2_gpu_step4.yaml) loads, and its spec as a
  dict equals gpu4's except name, out_dir, export, data_budget_s, wall_budget_s,
  drafter.init_from, train.lr and train.warmup_steps, which take the values it sets (so it trains
  on the same data lists, held-out sets and drafter shape)."""
  gpu4 = dataclasses.asdict(dflash.load_spec(CONFIGS / "train_dflash_smollm2_gpu_step4.yaml"))
  gpu4b = dataclasses.asdict(dflash.load_spec(CONFIGS / "train_dflash_smollm2_gpu_step5.yaml"))
  changed = {"name": "dflash_smollm2_gpu4b", "out_dir": "out/dflash_gpu4b",
             "export": "out/dflash_gpu4b/export/dflash.safetensors", "data_budget_s": 0, "wall_budget_s": 470}
  changed_drafter = {"init_from": "out/dflash_gpu4/export/dflash.safetensors"}
  changed_train = {"lr": 5.0e-4, "warmup_steps": 50}
  assert {k: gpu4b[k] for k in changed} == changed
  assert {k: gpu4b["drafter"][k] for k in changed_drafter} == changed_drafter
  assert {k: gpu4b["train"][k] for k in changed_train} == changed_train
  assert gpu4["train"]["lr"] != 5.0e-4 and gpu4["name"] != gpu4b["name"]
  expected = {**gpu4, **changed, "drafter": {**gpu4["drafter"], **changed_drafter},
              "train": {**gpu4["train"], **changed_train}}
  assert gpu4b == expected
  assert gpu4b["extra_data"] and gpu4b["heldout_data"]


def test_every_committed_training_spec_loads():
  """Every training spec under configs/ (train_{mtp,eagle3,dflash}_*.yaml) loads with its head's load_spec: `base:` chains and YAML merge keys resolve, every field
  is known, and no data source is an evaluation set; merge-key folders keep distinct folders;
  `specjax train data` reads it as the same head's spec."""
  from specjax.train import eagle3, mtp
  from specjax.train.cli import _data_spec
  loaders = {"mtp": mtp.load_spec, "eagle3": eagle3.load_spec, "dflash": dflash.load_spec}
  loaded = 0
  for path in sorted(CONFIGS.glob("train_*.yaml")):
    head = path.name.split("_")[1]                  # train_<head>_...
    assert head in loaders, path.name
    spec = loaders[head](path)
    for dc in (spec.data,) + tuple(spec.extra_data) + tuple(getattr(spec, "heldout_data", ())):
      for src in dc.sources:
        src.check()
    dirs = [spec.data.dir] + [e.dir for e in spec.extra_data]
    assert len(dirs) == len(set(dirs)), path.name
    assert type(_data_spec(path, {})) is type(spec), path.name     # `train data` reads every head's spec
    loaded += 1
  assert loaded >= 15
