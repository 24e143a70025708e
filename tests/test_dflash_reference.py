"""DFlash drafters travel: z-lab's layout (config.json with DFlashDraftModel, dflash_config
{mask_token_id, target_layer_ids}; safetensors with fc / hidden_norm / norm / layers.*) in and out.

- Round trip: a drafter made by specjax's own code in z-lab's form (mask_token_id, own final norm,
  Qwen3 layers), saved, exported with `specjax export-head` (sharded: index.json), loads back through
  the reference loader with identical parameters and drafts the same tokens (logits allclose, same
  accepted counts and output) inside speculative generation on a tiny target.
- A folder written from the reference names and config fields alone (numpy + safetensors) loads;
  its block logits equal a numpy transcription of z-lab's DFlashDraftModel forward (KV injection,
  q/k norm, rotate-half rotary, own norm, the target's LM head on the mask-token block), and
  generation with it is lossless (= plain greedy decoding).
- A learned-mask drafter is refused by the exporter, naming why; missing / unknown tensors and
  configs specjax cannot run exactly are one UserError each.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import TINY_LLAMA, random_params
from specjax.cli import main
from specjax.drafters.base import DraftParams
from specjax.drafters.dflash import DFlashConfig, init_dflash, load_dflash, make_dflash_drafter, save_dflash
from specjax.drafters.dflash import layer_config
from specjax.drafters.dflash_reference import export_file, load_reference
from specjax.drafters.registry import make_speculator
from specjax.engine import speculative_generate
from specjax.engine.decode import generate_plain
from specjax.errors import UserError
from specjax.models.decoder import forward
from specjax.models.kv_cache import KVCache
from specjax.models.load import LoadedModel
from specjax.train.dflash import DrafterConfig

CFG = TINY_LLAMA.replace(n_layers=4)
MASK_ID = 15
PROMPTS = [[1, 5, 9, 3, 5, 9, 3, 5], [2, 4, 6], [7, 7, 7, 7, 1, 2, 7, 7, 7]]
MAX_NEW = 20
H, KVH, HD, FFN = 2, 1, 16, 40      # the reference fixture's own attention / MLP sizes


@pytest.fixture(scope="module")
def target():
  return LoadedModel(name="tiny4", cfg=CFG, params=random_params(CFG, seed=0))


def _run(target, head):
  dp = DraftParams(n_max=3)
  drafter = make_speculator("dflash", target, head=str(head), draft_params=dp)
  return speculative_generate(target.params, target.cfg, PROMPTS, drafter, max_new_tokens=MAX_NEW, draft_params=dp)


def _noisy(pure, seed):
  """Every leaf moved off its init (zero output projections, unit norms), so every tensor matters."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x) + 0.3 * rng.standard_normal(x.shape), jnp.float32), pure)


def _block_logits(target, head, prompt):
  """The drafter's logits [1, 3, V] for the block after `prompt` (its last token is `last`)."""
  drafter = make_dflash_drafter(target, str(head), DraftParams(n_max=3), block_size=4)
  toks = jnp.asarray([prompt[:-1]], jnp.int32)
  lens = jnp.asarray([len(prompt) - 1], jnp.int32)
  cache = KVCache.init(CFG, 1, toks.shape[1])
  _, tapped, _ = forward(target.params, CFG, toks, cache, n_new=lens, taps=drafter.taps)
  st = drafter.init(drafter.weights, toks, lens, tapped, toks.shape[1] + 8)
  return np.asarray(drafter.logits(drafter.weights, st, jnp.asarray([prompt[-1]]), lens)), np.asarray(
      jnp.concatenate([t for t in tapped["layers"]], axis=-1)[0])


def test_export_then_reference_load_drafts_the_same(target, tmp_path):
  dc = DrafterConfig(taps=(0, 2), n_layers=2, block_size=4, window=64, mask_token_id=MASK_ID,
                     reference_layout=True).resolve(CFG)
  dparams = _noisy(init_dflash(CFG, dc, seed=3, target_params=target.params), 1)
  own = tmp_path / "own" / "dflash.safetensors"
  save_dflash(own, dparams, CFG, dc, dtype="float32")
  export_file(own, tmp_path / "ref", max_bytes=20_000)          # small shards: the index.json path
  assert (tmp_path / "ref" / "model.safetensors.index.json").is_file()
  assert main(["export-head", str(own), str(tmp_path / "ref1")]) == 0
  config = json.loads((tmp_path / "ref1" / "config.json").read_text())
  assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
  assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [0, 2]}

  a, dca, _ = load_dflash(own, CFG)
  b, dcb, _ = load_reference(tmp_path / "ref", CFG)
  assert layer_config(CFG, dca) == layer_config(CFG, dcb)          # the same layers, spelled out in full
  assert dataclasses.replace(dca, ffn_dim=None, layer_fields=()) == dataclasses.replace(dcb, ffn_dim=None, layer_fields=())
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
  np.testing.assert_allclose(_block_logits(target, own, PROMPTS[0])[0],
                             _block_logits(target, tmp_path / "ref", PROMPTS[0])[0], rtol=1e-5, atol=1e-5)
  ra, rb = _run(target, own), _run(target, tmp_path / "ref")
  assert ra.tokens == rb.tokens
  assert ra.stats.accepted_by_pos == rb.stats.accepted_by_pos and ra.stats.acc_tokens == rb.stats.acc_tokens


def test_a_learned_mask_drafter_is_refused_by_name(target, tmp_path):
  dc = DFlashConfig(taps=(0, 2), n_layers=1, block_size=4)
  own = tmp_path / "dflash.safetensors"
  save_dflash(own, init_dflash(CFG, dc, target_params=target.params), CFG, dc, dtype="float32")
  with pytest.raises(UserError, match="learned vector.*own `norm`.*llama layers"):
    export_file(own, tmp_path / "ref")
  assert main(["export-head", str(own), str(tmp_path / "ref")]) == 2


# ----------------------------------------------------------------------------------------------
# a folder from the reference names alone, and z-lab's forward in numpy


def _reference_folder(path, *, drop=None, extra=None, **config):
  rng = np.random.default_rng(5)
  d = CFG.d_model
  w = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
  near1 = lambda n: (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)
  t = {"fc.weight": w(d, 2 * d), "hidden_norm.weight": near1(d), "norm.weight": near1(d),
       "embed_tokens.weight": w(CFG.vocab_size, d)}
  for i in range(2):
    p = f"layers.{i}."
    t |= {p + "input_layernorm.weight": near1(d), p + "post_attention_layernorm.weight": near1(d),
          p + "self_attn.q_proj.weight": w(H * HD, d), p + "self_attn.k_proj.weight": w(KVH * HD, d),
          p + "self_attn.v_proj.weight": w(KVH * HD, d), p + "self_attn.o_proj.weight": w(d, H * HD),
          p + "self_attn.q_norm.weight": near1(HD), p + "self_attn.k_norm.weight": near1(HD),
          p + "mlp.gate_proj.weight": w(FFN, d), p + "mlp.up_proj.weight": w(FFN, d),
          p + "mlp.down_proj.weight": w(d, FFN)}
  t.pop(drop, None)
  t |= extra or {}
  path.mkdir(parents=True)
  from safetensors.numpy import save_file
  save_file({"model." + k: v for k, v in t.items()}, str(path / "model.safetensors"))
  (path / "config.json").write_text(json.dumps({
      "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": d, "intermediate_size": FFN,
      "num_hidden_layers": 2, "num_attention_heads": H, "num_key_value_heads": KVH, "head_dim": HD,
      "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": CFG.vocab_size, "attention_bias": False,
      "block_size": 4, "num_target_layers": CFG.n_layers, "layer_types": ["full_attention"] * 2,
      "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [0, 2]}, **config}))
  return path, t


def _zlab_logits(t, target, ctx_taps, ids, start):
  """z-lab DFlashDraftModel.forward + target.lm_head, in numpy: ctx_taps [S, 2D] at positions 0..S-1,
  block ids [Bk] at positions start..start+Bk-1 -> logits [Bk - 1, V] of slots 1..Bk-1."""
  tp = nnx.to_pure_dict(target.params)
  emb = np.asarray(tp["embed_tokens"]["embedding"], np.float64)
  norm = lambda x, g: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * g
  inv = 1.0 / 10000.0 ** (np.arange(0, HD, 2) / HD)

  def rot(x, pos):                                                 # x [T, heads, HD]: HF rotate_half
    ang = np.concatenate([pos[:, None] * inv[None]] * 2, -1)[:, None, :]       # [T, 1, HD]
    x1, x2 = x[..., :HD // 2], x[..., HD // 2:]
    return x * np.cos(ang) + np.concatenate([-x2, x1], -1) * np.sin(ang)

  s, bk = ctx_taps.shape[0], len(ids)
  ctx = norm(ctx_taps @ t["fc.weight"].T, t["hidden_norm.weight"])                # [S, D]
  x = emb[ids]                                                                    # [Bk, D]
  qpos, kpos = np.arange(start, start + bk), np.concatenate([np.arange(s), np.arange(start, start + bk)])
  for i in range(2):
    g = lambda n: t[f"layers.{i}.{n}"]
    h = norm(x, g("input_layernorm.weight"))
    q = norm((h @ g("self_attn.q_proj.weight").T).reshape(bk, H, HD), g("self_attn.q_norm.weight"))
    both = np.concatenate([ctx, h])                                               # [S + Bk, D]
    k = norm((both @ g("self_attn.k_proj.weight").T).reshape(s + bk, KVH, HD), g("self_attn.k_norm.weight"))
    v = (both @ g("self_attn.v_proj.weight").T).reshape(s + bk, KVH, HD)
    q, k = rot(q, qpos), rot(k, kpos)
    k, v = np.repeat(k, H // KVH, 1), np.repeat(v, H // KVH, 1)
    att = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(HD)                           # non-causal
    att = np.exp(att - att.max(-1, keepdims=True))
    o = np.einsum("hqk,khd->qhd", att / att.sum(-1, keepdims=True), v).reshape(bk, H * HD)
    x = x + o @ g("self_attn.o_proj.weight").T
    h = norm(x, g("post_attention_layernorm.weight"))
    gate = h @ g("mlp.gate_proj.weight").T
    x = x + (gate / (1 + np.exp(-gate)) * (h @ g("mlp.up_proj.weight").T)) @ g("mlp.down_proj.weight").T
  head = np.asarray(tp["lm_head"]["kernel"], np.float64)                          # [V, D]
  return (norm(x, t["norm.weight"]) @ head.T)[1:]


def test_a_reference_folder_loads_drafts_as_zlab_and_losslessly(target, tmp_path):
  folder, t = _reference_folder(tmp_path / "ref")
  _, dc, _ = load_reference(folder, CFG)
  assert (dc.taps, dc.mask_token_id, dc.block_size, dc.final_norm, dc.ffn_dim) == ((0, 2), MASK_ID, 4, True, FFN)
  prompt = PROMPTS[2]
  got, taps = _block_logits(target, folder, prompt)
  want = _zlab_logits({k: v.astype(np.float64) for k, v in t.items()}, target, taps.astype(np.float64),
                      np.asarray([prompt[-1]] + [MASK_ID] * 3), len(prompt) - 1)
  np.testing.assert_allclose(got[0], want, rtol=2e-4, atol=2e-4)
  plain = generate_plain(target.params, target.cfg, PROMPTS, max_new_tokens=MAX_NEW).tokens
  run = _run(target, folder)
  assert run.tokens == plain and run.stats.acc_tokens > 0


def test_reference_folder_errors_name_the_problem(target, tmp_path):
  with pytest.raises(UserError, match="layers.1.self_attn.k_norm.weight"):
    load_reference(_reference_folder(tmp_path / "a", drop="layers.1.self_attn.k_norm.weight")[0], CFG)
  with pytest.raises(UserError, match="no place for: \\['lm_head.weight'\\]"):
    load_reference(_reference_folder(tmp_path / "b", extra={"lm_head.weight": np.zeros((16, 32), np.float32)})[0], CFG)
  with pytest.raises(UserError, match="hidden_size 48 != 32"):
    load_reference(_reference_folder(tmp_path / "c", hidden_size=48)[0], CFG)
  with pytest.raises(UserError, match="reach the target's last layer 3"):
    load_reference(_reference_folder(tmp_path / "d", dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 3]})[0], CFG)
  with pytest.raises(UserError, match="DFlash 2"):
    load_reference(_reference_folder(tmp_path / "e", architectures=["DFlash2DraftModel"])[0], CFG)
