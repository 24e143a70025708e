"""EAGLE-3 heads travel: the reference layout (config.json + model.safetensors, as SGLang's
`LlamaForCausalLMEagle3.load_weights` reads it) in and out.

- Round trip: a head saved by specjax, exported with `specjax export-head`, loads back through the
  reference loader with identical parameters and d2t, and drafts exactly the same tokens
  (the same accepted counts per position, the same output) as the specjax file.
- A folder written from the reference key names alone (with the extra `embed_tokens.weight` copy
  reference exports carry) loads and drafts losslessly; a missing tensor and a head for another
  target are one UserError each, naming the problem.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from conftest import TINY_LLAMA
from specjax.cli import main
from specjax.engine.decode import generate_plain
from specjax.drafters.base import DraftParams
from specjax.drafters.eagle3 import Eagle3Config, build_d2t, init_head, load_head, save_head
from specjax.drafters.eagle3_reference import ARCHITECTURE, load_reference
from specjax.drafters.registry import make_speculator
from specjax.engine import speculative_generate
from specjax.errors import UserError
from specjax.models.load import LoadedModel

VD = 12
PROMPTS = [[1, 5, 9, 3, 5, 9, 3, 5], [2, 4, 6], [7, 7, 7, 7, 1, 2, 7, 7, 7]]
MAX_NEW = 20


@pytest.fixture(scope="module")
def target(tiny_llama):
  cfg, params = tiny_llama
  return LoadedModel(name="tiny", cfg=cfg, params=params)


def _run(target, head):
  dp = DraftParams(n_max=3)
  drafter = make_speculator("eagle3", target, head=str(head), draft_params=dp)
  return speculative_generate(target.params, target.cfg, PROMPTS, drafter, max_new_tokens=MAX_NEW, draft_params=dp)


def test_export_then_reference_load_drafts_the_same(target, tmp_path):
  hc = Eagle3Config.make(TINY_LLAMA, VD)
  d2t = build_d2t([np.repeat(np.arange(16), np.arange(16, 0, -1))], TINY_LLAMA.vocab_size, VD)
  hp = init_head(hc, 3, target_params=target.params, d2t=d2t)
  own = tmp_path / "own" / "eagle3_head.safetensors"
  save_head(own, hp, d2t, hc, dtype="float32")
  assert main(["export-head", str(own), str(tmp_path / "ref")]) == 0
  config = json.loads((tmp_path / "ref" / "config.json").read_text())
  assert config["architectures"] == [ARCHITECTURE] and config["draft_vocab_size"] == VD
  assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(hc.tap_layers)

  a, da, hca, _ = load_head(own, TINY_LLAMA)
  b, db, hcb, _ = load_reference(tmp_path / "ref", TINY_LLAMA)
  assert hca == hcb and np.array_equal(da, db)
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
  ra, rb = _run(target, own), _run(target, tmp_path / "ref")
  assert ra.tokens == rb.tokens
  assert ra.stats.accepted_by_pos == rb.stats.accepted_by_pos and ra.stats.acc_tokens == rb.stats.acc_tokens


def _reference_folder(path, *, drop=None, hidden=None):
  """A head folder written from the reference names and config fields only (random weights)."""
  from safetensors.numpy import save_file
  cfg = TINY_LLAMA
  d, h, kvh, hd, ffn = hidden or cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 48
  rng = np.random.default_rng(0)
  w = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
  tensors = {"fc.weight": w(d, 3 * d), "midlayer.input_layernorm.weight": 1 + w(d) * 0.1,
             "midlayer.hidden_norm.weight": 1 + w(d) * 0.1, "midlayer.post_attention_layernorm.weight": 1 + w(d) * 0.1,
             "midlayer.self_attn.q_proj.weight": w(h * hd, 2 * d), "midlayer.self_attn.k_proj.weight": w(kvh * hd, 2 * d),
             "midlayer.self_attn.v_proj.weight": w(kvh * hd, 2 * d), "midlayer.self_attn.o_proj.weight": w(d, h * hd),
             "midlayer.mlp.gate_proj.weight": w(ffn, d), "midlayer.mlp.up_proj.weight": w(ffn, d),
             "midlayer.mlp.down_proj.weight": w(d, ffn), "norm.weight": 1 + w(d) * 0.1, "lm_head.weight": w(VD, d),
             "embed_tokens.weight": w(cfg.vocab_size, d),
             "d2t": np.asarray([0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3], np.int64),       # target id - draft id
             "t2d": np.zeros((cfg.vocab_size,), bool)}
  tensors.pop(drop, None)
  path.mkdir(parents=True)
  save_file(tensors, str(path / "model.safetensors"))
  (path / "config.json").write_text(json.dumps({
      "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": d, "intermediate_size": ffn,
      "num_attention_heads": h, "num_key_value_heads": kvh, "head_dim": hd, "num_hidden_layers": 1,
      "vocab_size": cfg.vocab_size, "draft_vocab_size": VD, "rms_norm_eps": 1e-6, "rope_theta": cfg.rope_theta,
      "tie_word_embeddings": False, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}}))
  return path


def test_a_reference_folder_loads_and_drafts_losslessly(target, tmp_path):
  folder = _reference_folder(tmp_path / "ref")
  hp, d2t, hc, _ = load_reference(folder, TINY_LLAMA)
  assert hc.tap_layers == (0, 1, 1) and hc.ffn_dim == 48
  assert d2t.tolist() == [0, 1, 3, 4, 6, 7, 9, 10, 11, 12, 13, 14]
  plain = generate_plain(target.params, target.cfg, PROMPTS, max_new_tokens=MAX_NEW).tokens
  assert _run(target, folder).tokens == plain


def test_reference_folder_errors_name_the_problem(target, tmp_path):
  with pytest.raises(UserError, match="norm.weight"):
    load_reference(_reference_folder(tmp_path / "a", drop="norm.weight"), TINY_LLAMA)
  with pytest.raises(UserError, match=r"hidden_size 48 != 32|does not fit"):
    load_reference(_reference_folder(tmp_path / "b", hidden=48), TINY_LLAMA)
