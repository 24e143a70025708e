"""MTP heads travel: DeepSeek-V3's (`model.layers.{L+m}.` enorm / hnorm / eh_proj / shared_head.*) and
Qwen3-Next's (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.layers.{m}.*`, `mtp.norm`) layouts in and out.

- Round trip: heads made by specjax's own code in a reference style, exported, load back through
  the reference loader with identical parameters, the same step logits, and the same drafts
  (tokens, accepted counts) inside speculative generation on a tiny target; both layouts.
- Folders written from the reference key names and config fields alone (numpy + safetensors) load
  and draft losslessly (= plain greedy decoding).
- A specjax-trained head is refused by `specjax export-head`, saying why; missing / unknown tensors
  and heads for another target are one UserError each, naming the problem.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_LLAMA
from specjax.cli import main
from specjax.drafters.base import DraftParams
from specjax.drafters.mtp import MTPDrafter, apply_head, init_heads, make_mtp_drafter, save_heads
from specjax.drafters.mtp_reference import export_reference, init_reference_heads, load_reference
from specjax.drafters.registry import make_speculator
from specjax.engine import speculative_generate
from specjax.engine.decode import generate_plain
from specjax.errors import UserError
from specjax.models.load import LoadedModel

CFG = TINY_LLAMA
PROMPTS = [[1, 5, 9, 3, 5, 9, 3, 5], [2, 4, 6], [7, 7, 7, 7, 1, 2, 7, 7, 7]]
MAX_NEW = 20


@pytest.fixture(scope="module")
def target(tiny_llama):
  cfg, params = tiny_llama
  return LoadedModel(name="tiny", cfg=cfg, params=params)


def _run(target, head, n_max=3):
  dp = DraftParams(n_max=n_max)
  drafter = make_speculator("mtp", target, head=head if isinstance(head, tuple) else str(head), draft_params=dp)
  return speculative_generate(target.params, target.cfg, PROMPTS, drafter, max_new_tokens=MAX_NEW, draft_params=dp)


def _step_logits(drafter: MTPDrafter, m: int):
  """Head m's next-token logits on fixed inputs (one entry per position, causal), via the drafter."""
  rng = np.random.default_rng(2)
  emb = jnp.asarray(rng.standard_normal((1, 5, CFG.d_model)), jnp.float32)
  h = jnp.asarray(rng.standard_normal((1, 5, CFG.d_model)), jnp.float32)
  pos = jnp.arange(5)[None]
  mask = jnp.tril(jnp.ones((5, 5), bool))[None]
  o, _ = apply_head(drafter.weights["heads"][m], CFG, emb, h, pos, lambda k, v: (k, v), {"full": mask, "sliding": mask})
  return np.asarray(jax.vmap(lambda x: drafter._pick(drafter.weights, m, x[:, None])[1], in_axes=1)(o))


@pytest.mark.parametrize("style", ["deepseek_v3", "qwen3_next"])
def test_export_then_reference_load_drafts_the_same(target, tmp_path, style):
  heads, outs = init_reference_heads(CFG, 2, target.params, seed=1, own_lm_head=style == "deepseek_v3")
  rng = np.random.default_rng(0)
  shared = 1 + 0.2 * rng.standard_normal(CFG.d_model)
  outs = tuple({**o, "norm": jnp.asarray(shared if style == "qwen3_next" else 1 + 0.2 * rng.standard_normal(CFG.d_model),
                                         jnp.float32)} for o in outs)
  if style == "qwen3_next":              # one mtp.fc and pre-fc norms for every layer
    heads = tuple({**hp, **{k: heads[0][k] for k in ("eh_proj", "enorm", "hnorm")}} for hp in heads)
  export_reference(tmp_path / "ref", heads, outs, CFG, style, dtype="float32")
  config = json.loads((tmp_path / "ref" / "config.json").read_text())
  assert config["num_nextn_predict_layers"] == 2 and config["num_hidden_layers"] == CFG.n_layers

  heads_b, outs_b, style_b, _ = load_reference(tmp_path / "ref", CFG)
  assert style_b == style
  same = lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  jax.tree_util.tree_map(same, (heads, outs), (heads_b, outs_b))
  a = make_mtp_drafter(target, (heads, outs, style), DraftParams(n_max=3))
  b = make_mtp_drafter(target, str(tmp_path / "ref"), DraftParams(n_max=3))
  assert b.style == style
  for m in range(2):
    np.testing.assert_allclose(_step_logits(a, m), _step_logits(b, m), rtol=1e-6)
  ra, rb = _run(target, (heads, outs, style)), _run(target, tmp_path / "ref")
  assert ra.tokens == rb.tokens
  assert ra.stats.accepted_by_pos == rb.stats.accepted_by_pos and ra.stats.acc_tokens == rb.stats.acc_tokens


def test_a_specjax_trained_head_is_refused_with_the_reason(tmp_path):
  own = tmp_path / "mtp_head.safetensors"
  save_heads(own, init_heads(CFG, 1), CFG, dtype="float32")
  assert main(["export-head", str(own), str(tmp_path / "ref")]) == 2
  assert not (tmp_path / "ref" / "config.json").exists()


# ----------------------------------------------------------------------------------------------
# folders from the reference names alone


def _layer(rng, prefix):
  d, h, kvh, hd, f = CFG.d_model, CFG.n_heads, CFG.n_kv_heads, CFG.head_dim, CFG.ffn_dim
  w = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
  near1 = lambda n: (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)
  return {prefix + "input_layernorm.weight": near1(d), prefix + "post_attention_layernorm.weight": near1(d),
          prefix + "self_attn.q_proj.weight": w(h * hd, d), prefix + "self_attn.k_proj.weight": w(kvh * hd, d),
          prefix + "self_attn.v_proj.weight": w(kvh * hd, d), prefix + "self_attn.o_proj.weight": w(d, h * hd),
          prefix + "mlp.gate_proj.weight": w(f, d), prefix + "mlp.up_proj.weight": w(f, d),
          prefix + "mlp.down_proj.weight": w(d, f)}


def _reference_folder(path, style, *, drop=None, extra=None, **config):
  from safetensors.numpy import save_file
  rng = np.random.default_rng(7)
  d, v, L = CFG.d_model, CFG.vocab_size, CFG.n_layers
  w = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
  near1 = lambda n: (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)
  if style == "deepseek_v3":
    p = f"model.layers.{L}."
    t = {p + "enorm.weight": near1(d), p + "hnorm.weight": near1(d), p + "eh_proj.weight": w(d, 2 * d),
         p + "shared_head.norm.weight": near1(d), p + "shared_head.head.weight": w(v, d),
         p + "embed_tokens.weight": w(v, d), **_layer(rng, p)}
    meta = {"num_nextn_predict_layers": 1}
  else:
    t = {"mtp.fc.weight": w(d, 2 * d), "mtp.pre_fc_norm_embedding.weight": near1(d),
         "mtp.pre_fc_norm_hidden.weight": near1(d), "mtp.norm.weight": near1(d), **_layer(rng, "mtp.layers.0.")}
    meta = {"mtp_num_hidden_layers": 1}
  t.pop(drop, None)
  t |= extra or {}
  path.mkdir(parents=True)
  save_file(t, str(path / "model.safetensors"))
  (path / "config.json").write_text(json.dumps({
      "model_type": "llama", "hidden_size": d, "intermediate_size": CFG.ffn_dim, "num_hidden_layers": L,
      "num_attention_heads": CFG.n_heads, "num_key_value_heads": CFG.n_kv_heads, "vocab_size": v,
      "rms_norm_eps": 1e-6, **meta, **config}))
  return path


@pytest.mark.parametrize("style", ["deepseek_v3", "qwen3_next"])
def test_a_reference_folder_loads_and_drafts_losslessly(target, tmp_path, style):
  folder = _reference_folder(tmp_path / "ref", style)
  heads, outs, got_style, _ = load_reference(folder, CFG)
  assert got_style == style and len(heads) == 1 and ("lm_head" in outs[0]) == (style == "deepseek_v3")
  plain = generate_plain(target.params, target.cfg, PROMPTS, max_new_tokens=MAX_NEW).tokens
  assert _run(target, folder).tokens == plain


def test_reference_folder_errors_name_the_problem(target, tmp_path):
  with pytest.raises(UserError, match="model.layers.2.hnorm.weight"):
    load_reference(_reference_folder(tmp_path / "a", "deepseek_v3", drop="model.layers.2.hnorm.weight"), CFG)
  with pytest.raises(UserError, match="mtp.norm.weight"):
    load_reference(_reference_folder(tmp_path / "b", "qwen3_next", drop="mtp.norm.weight"), CFG)
  with pytest.raises(UserError, match=r"no place for: \['mtp.layers.0.self_attn.q_norm.weight'\]"):
    load_reference(_reference_folder(tmp_path / "c", "qwen3_next",
                                     extra={"mtp.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)}), CFG)
  with pytest.raises(UserError, match="hidden_size 48 != 32"):
    load_reference(_reference_folder(tmp_path / "d", "deepseek_v3", hidden_size=48), CFG)
