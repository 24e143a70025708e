"""A Llama-3.1-shaped GGUF (rope scaling carried as `rope_freqs.weight`) loads and runs as the
transformers checkpoint it was converted from.

The file is written here with the `gguf` package from a tiny random transformers Llama with
llama3 rope scaling, as llama.cpp's converter writes one: Q / K rows permuted for llama.cpp's
interleaved rotary, `rope_freqs.weight` holding the llama3 rule's divisor per rotary frequency
(computed here from the rule's definition, independently of specjax), and a byte-level BPE
vocabulary. Properties: prefill logits equal transformers' (1e-4 relative to the largest logit,
positions past the original context, where the scaling matters), `specjax generate --model FILE`
runs on a text prompt, a tensor with no place in the model is an error that names it, and the
lazy loader reads every tensor once.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import HF_VOCAB

# byte-level BPE symbols: "<s>", "</s>", the printable ASCII bytes "!" to "|", one merge ("ab") and
# the space byte's symbol ("\u0120"): HF_VOCAB (96) tokens, so every id of the model is a token
TOKENS = ["<s>", "</s>"] + [chr(c) for c in range(33, 125)] + ["ab", "\u0120"]


def _llama3_divisors(hc) -> np.ndarray:
  """The per-frequency divisors llama.cpp's converter stores for a llama3 rope_scaling config."""
  rs = dict(getattr(hc, "rope_parameters", None) or hc.rope_scaling)      # transformers 5 | 4
  theta = rs.get("rope_theta") or hc.rope_theta
  factor, low, high, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
  dim = hc.head_dim
  out = []
  for i in range(0, dim, 2):
    freq = 1.0 / theta ** (i / dim)
    wavelen = 2 * math.pi / freq
    if wavelen < old / high:
      out.append(1.0)
    elif wavelen > old / low:
      out.append(factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      out.append(1.0 / ((1 - smooth) / factor + smooth))
  return np.asarray(out, np.float32)


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's Q / K row order: each head's two rotary halves interleaved."""
  return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama31_gguf(model, path, extra: dict | None = None) -> None:
  import gguf
  hc = model.config
  sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_context_length(hc.max_position_embeddings)
  w.add_embedding_length(hc.hidden_size)
  w.add_block_count(hc.num_hidden_layers)
  w.add_feed_forward_length(hc.intermediate_size)
  w.add_head_count(hc.num_attention_heads)
  w.add_head_count_kv(hc.num_key_value_heads)
  w.add_key_length(hc.head_dim)
  w.add_value_length(hc.head_dim)
  w.add_rope_dimension_count(hc.head_dim)
  w.add_rope_freq_base((getattr(hc, "rope_parameters", None) or {}).get("rope_theta") or hc.rope_theta)
  w.add_layer_norm_rms_eps(hc.rms_norm_eps)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("llama-bpe")
  w.add_token_list(TOKENS)
  w.add_token_types([3, 3] + [1] * (len(TOKENS) - 2))
  w.add_token_merges(["a b"])
  w.add_bos_token_id(0)
  w.add_eos_token_id(1)
  w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
  w.add_tensor("output_norm.weight", sd["model.norm.weight"])
  w.add_tensor("output.weight", sd["lm_head.weight"])
  w.add_tensor("rope_freqs.weight", _llama3_divisors(hc))
  names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
           "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
  for i in range(hc.num_hidden_layers):
    for hf, gg in names.items():
      t = sd[f"model.layers.{i}.{hf}.weight"]
      if gg == "attn_q":
        t = _permute(t, hc.num_attention_heads)
      elif gg == "attn_k":
        t = _permute(t, hc.num_key_value_heads)
      w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
  for name, t in (extra or {}).items():
    w.add_tensor(name, t)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.fixture(scope="module")
def llama31(hf_tiny, tmp_path_factory):
  pair = hf_tiny("llama3_rope")
  path = tmp_path_factory.mktemp("gguf") / "llama31_tiny.gguf"
  write_llama31_gguf(pair.hf, path)
  return pair, path


def test_logits_equal_transformers_past_the_original_context(llama31):
  import torch
  import jax.numpy as jnp

  from conftest import jit_forward
  from specjax.models.kv_cache import KVCache
  from specjax.models.load import load_model
  pair, path = llama31
  model = load_model(str(path), progress=False)
  assert model.cfg.rope_scaling[0] == "freq_factors"
  ids = np.random.default_rng(0).integers(2, HF_VOCAB, (2, 40)).astype(np.int32)   # original context: 16
  with torch.no_grad():
    ref = pair.hf(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
  ours, _, _ = jit_forward(model.params, model.cfg, jnp.asarray(ids), KVCache.init(model.cfg, 2, 64))
  err = float(np.max(np.abs(np.asarray(ours, np.float64) - ref)) / np.max(np.abs(ref)))
  assert err <= 1e-4, f"GGUF logits differ from transformers: rel err {err:.3g}"
  # without the divisors the frequencies are Llama-3's unscaled ones, and the logits differ
  unscaled = model.cfg.replace(rope_scaling=()) if hasattr(model.cfg, "replace") else None
  if unscaled is not None:
    off, _, _ = jit_forward(model.params, unscaled, jnp.asarray(ids), KVCache.init(unscaled, 2, 64))
    assert float(np.max(np.abs(np.asarray(off) - ref)) / np.max(np.abs(ref))) > 1e-3


def test_generate_command_runs_on_the_file(llama31, capsys):
  """`specjax generate --model FILE "text"` prints the greedy continuation of the file's own
  tokenization of the text (the engine's answer for the same ids) and its speed."""
  from specjax.cli import main
  from specjax.engine.decode import generate_plain
  from specjax.models.load import load_model
  _, path = llama31
  main(["generate", "--model", str(path), "--max-new-tokens", "6", "hello world"])
  out = capsys.readouterr()
  model = load_model(str(path), progress=False)
  ids = model.tokenizer.encode("hello world")
  want = model.tokenizer.decode(generate_plain(model.params, model.cfg, [ids], max_new_tokens=6).tokens[0])
  assert out.out.rstrip("\n") == want and "6 tokens in" in out.err


def test_a_tensor_with_no_place_is_named(hf_tiny, tmp_path):
  from specjax.models.load import load_model
  path = tmp_path / "extra.gguf"
  write_llama31_gguf(hf_tiny("llama3_rope").hf, path, extra={"blk.0.attn_rot_embd.weight": np.zeros(4, np.float32)})
  with pytest.raises(ValueError, match="blk.0.attn_rot_embd"):
    load_model(str(path), progress=False)


def test_lazy_tensors_are_read_one_at_a_time(llama31):
  """The GGUF mapping dequantizes on access (nothing is read before the weights are filled) and
  gives what a whole read gives."""
  from gguf import GGUFReader
  from specjax.io.gguf import load_gguf
  _, path = llama31
  hf, tensors = load_gguf(path, reader=GGUFReader(str(path)))
  assert hf["rope_scaling"]["rope_type"] == "freq_factors" and "rope_freqs.weight" not in tensors
  a = tensors["model.layers.1.self_attn.q_proj.weight"]
  b = tensors["model.layers.1.self_attn.q_proj.weight"]
  assert a.dtype == np.float32 and a.shape == (64, 64) and np.array_equal(a, b) and a is not b
