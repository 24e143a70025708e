"""EAGLE-3 heads in the layout the EAGLE code, SpecForge, SGLang and vLLM read: a folder with a
Llama-style `config.json` (architectures ["LlamaForCausalLMEagle3"]) and `model.safetensors`.

Followed field by field from SGLang's loader (`python/sglang/srt/models/llama_eagle3.py`,
`LlamaForCausalLMEagle3.load_weights`, and `set_eagle3_layers_to_capture` in `models/llama.py`):
- tensors `fc.weight` [d, 3 * target_hidden], `midlayer.{input_layernorm, hidden_norm,
  post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v take
  2 * d inputs: embedding and hidden state), `midlayer.mlp.{gate,up,down}_proj.weight`,
  `norm.weight`, `lm_head.weight` [draft_vocab, d], `d2t` (target id - draft id, int64) and
  `t2d` (bool [vocab]); an `embed_tokens.weight` copy of the target's embedding may be present and
  is not needed (the head shares the target's);
- config: `hidden_size`, `intermediate_size`, `num_attention_heads`, `num_key_value_heads`,
  `head_dim`, `num_hidden_layers` 1, `vocab_size` (the target's), `draft_vocab_size`,
  `rms_norm_eps`, `rope_theta`, `max_position_embeddings`, `tie_word_embeddings` false,
  `target_hidden_size` when it differs, and `eagle_config.eagle_aux_hidden_state_layer_ids`: the
  target layers whose outputs feed `fc` (default [1, L/2 - 1, L - 4]: the inputs of layers 2,
  L/2, L - 3), the same indexing as `Eagle3Config.tap_layers`.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp

from specjax.errors import UserError
from specjax.models.config import ModelConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"
NOT_NEEDED = ("embed_tokens.weight", "t2d")


def is_reference_folder(path) -> bool:
  """A folder whose config.json names the reference EAGLE-3 architecture."""
  cfg = Path(path) / "config.json"
  if not cfg.is_file():
    return False
  try:
    return ARCHITECTURE in (json.loads(cfg.read_text()).get("architectures") or [])
  except ValueError:
    return False


def export_reference(folder, hp, d2t, hc, *, dtype="bfloat16") -> Path:
  """Write head `hp` (pure dict or nnx.State) with its d2t [Vd] and Eagle3Config to `folder` in the
  reference layout. -> the folder."""
  from safetensors.numpy import save_file

  from specjax.drafters.eagle3 import head_tensors
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  t = hc.target
  save_file(head_tensors(hp, d2t, hc, dtype), str(folder / "model.safetensors"), metadata={"format": "pt"})
  config = {
      "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": t.d_model,
      "intermediate_size": hc.ffn_dim, "num_attention_heads": t.n_heads, "num_key_value_heads": t.n_kv_heads,
      "head_dim": t.head_dim, "num_hidden_layers": 1, "vocab_size": t.vocab_size,
      "draft_vocab_size": hc.draft_vocab, "rms_norm_eps": float(f"{t.norm_eps:.6g}"), "rope_theta": t.rope_theta,
      "max_position_embeddings": 8192, "hidden_act": "silu", "tie_word_embeddings": False,
      "torch_dtype": str(jnp.dtype(dtype)), "target_hidden_size": t.d_model,
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(hc.tap_layers), "use_aux_hidden_state": True}}
  (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  return folder


def load_reference(folder, cfg: ModelConfig, dtype=None):
  """(head params as a pure dict, d2t [Vd] int32, Eagle3Config, config.json) of a reference-layout
  folder for target `cfg`; refuses a head whose sizes are not this target's, and tensors it does
  not know."""
  from safetensors.numpy import load_file

  from specjax.drafters.eagle3 import Eagle3Config, read_head_tensors
  folder = Path(folder)
  meta = json.loads((folder / "config.json").read_text())
  want = {"hidden_size": cfg.d_model, "target_hidden_size": cfg.d_model, "vocab_size": cfg.vocab_size,
          "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim}
  bad = [f"{k} {meta[k]} != {v}" for k, v in want.items() if meta.get(k) is not None and meta[k] != v]
  if bad:
    raise UserError(f"EAGLE-3 head {folder} does not fit this target ({cfg.arch}): {', '.join(bad)}")
  if int(meta.get("num_hidden_layers", 1)) != 1:
    raise UserError(f"EAGLE-3 head {folder}: {meta['num_hidden_layers']} decoder layers; specjax runs one-layer heads")
  files = sorted(folder.glob("*.safetensors"))
  if not files:
    raise UserError(f"EAGLE-3 head {folder} has no *.safetensors file")
  flat = {}
  for f in files:
    flat.update(load_file(str(f)))
  taps = (meta.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
  draft_vocab = int(meta.get("draft_vocab_size") or meta.get("vocab_size"))
  try:
    hc = Eagle3Config.make(cfg, draft_vocab, int(meta["intermediate_size"]), taps)
  except ValueError as e:
    raise UserError(f"EAGLE-3 head {folder}: {e}") from None
  for name in NOT_NEEDED:
    flat.pop(name, None)
  pure, d2t = read_head_tensors(flat, hc, f"EAGLE-3 head {folder}", dtype)
  return pure, d2t, hc, meta


def export_file(head_path, out) -> Path:
  """A specjax EAGLE-3 head file (`X.safetensors` + `X.json`, or its folder) rewritten in the
  reference layout under `out`, for the target recorded in its JSON."""
  import dataclasses

  from specjax.drafters.eagle3 import head_paths, load_head
  _, cpath = head_paths(head_path)
  if not cpath.is_file():
    raise UserError(f"{head_path}: no specjax EAGLE-3 head config {cpath}")
  meta = json.loads(cpath.read_text())
  tc = meta["target_config"]
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in tc.items() if k in fields})
  hp, d2t, hc, _ = load_head(head_path, cfg)
  return export_reference(out, hp, d2t, hc, dtype=meta.get("dtype", "bfloat16"))
