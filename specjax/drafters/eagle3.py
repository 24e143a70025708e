"""An EAGLE-3 head: its shape, modules, parameters, draft vocabulary and head files.

The head (SafeAILab EAGLE-3, `docs/REFERENCE.md` section 5):
  g_p   = fc(concat(low_p, mid_p, high_p))                 the target's hidden states entering layers
                                                           2, N//2 and N-3 (3 x d_model -> d_model)
  h'    = layer(concat(input_layernorm(embed(t)), hidden_norm(h)))   one llama decoder layer whose q/k/v
                                                           read the 2 x d_model concatenation; its residual
                                                           stream starts from h
  logits = lm_head(norm(h'))                               over a reduced draft vocabulary of Vd tokens;
                                                           `d2t[i]` is draft token i's target id
The embedding is the target's (frozen). Recursive drafting feeds the head's own pre-norm output h'
back as h.

The drafters that run the head (`eagle3` chains, `eagle3_tree` EAGLE-2 trees) are in
`specjax/drafters/eagle3_drafter.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters import head_file
from specjax.drafters.head_file import (abstract_params, check_target, fused_sizes, graphdef_of, params_of,
                                        params_from_tensors, refuse_unplaced, tensors_from)
from specjax.models.config import ModelConfig
from specjax.models.decoder import attention_masks, model_of
from specjax.models.layers import MLP, Linear, RMSNorm, attend, qkv_layout, rope, split_qkv
from specjax.models.kv_cache import KVCache
from specjax.models.weights import hf_names

FORMAT = "specjax-eagle3-v1"


def default_tap_layers(n_layers: int) -> tuple[int, int, int]:
  """EAGLE-3 fuses the hidden states *entering* layers 2, N//2 and N-3, i.e. the outputs of layers
  1, N//2 - 1 and N - 4 (clipped into the model for tiny test configs)."""
  return tuple(min(max(layer, 0), n_layers - 1) for layer in (1, n_layers // 2 - 1, n_layers - 4))


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
  """Static shape of a head: the target it drafts for, its draft vocabulary and MLP width, and
  which target layers (outputs) feed `fc` as low / mid / high."""
  target: ModelConfig
  draft_vocab: int
  ffn_dim: int
  tap_layers: tuple[int, int, int]

  @staticmethod
  def make(target: ModelConfig, draft_vocab: int, ffn_dim: int | None = None, tap_layers=None) -> "Eagle3Config":
    if not 0 < draft_vocab <= target.vocab_size:
      raise ValueError(f"draft_vocab must be in [1, {target.vocab_size}], got {draft_vocab}")
    taps = tuple(int(x) for x in (tap_layers or default_tap_layers(target.n_layers)))
    if len(taps) != 3 or not all(0 <= t < target.n_layers for t in taps):
      raise ValueError(f"tap_layers must be 3 layer indices of the target (< {target.n_layers}), got {taps}")
    return Eagle3Config(target=target, draft_vocab=int(draft_vocab), ffn_dim=int(ffn_dim or target.ffn_dim),
                        tap_layers=taps)

  @property
  def layer(self) -> ModelConfig:
    """The head's decoder layer: llama-style whatever the target's family, the target's widths."""
    return self.target.replace(arch="llama", n_layers=1, layer_types=("full",), ffn_dim=self.ffn_dim,
                               sliding_window=None, qkv_bias=False, o_bias=False, qk_norm=False,
                               sandwich_norm=False, embed_scale=False, norm_offset=False, activation="silu",
                               query_scale=None, rope_local_theta=None)

  @property
  def taps(self) -> tuple[int, ...]:
    """The target layers to tap, sorted and unique (the order the decoder returns them in)."""
    return tuple(sorted(set(self.tap_layers)))

  @property
  def tap_slots(self) -> tuple[int, int, int]:
    """Index into the decoder's tapped tuple of low, mid, high."""
    return tuple(self.taps.index(t) for t in self.tap_layers)


class Eagle3Attention(nnx.Module):
  """The layer's projections: q/k/v read the 2 x d_model input (one fused matrix), o writes d_model."""

  def __init__(self, d: int, h: int, kvh: int, hd: int, *, dtype, rngs: nnx.Rngs):
    self.qkv_proj = Linear(2 * d, (h + 2 * kvh) * hd, bias=False, dtype=dtype, rngs=rngs, fused=qkv_layout(h, kvh, hd))
    self.o_proj = Linear(h * hd, d, bias=False, dtype=dtype, rngs=rngs)


class Eagle3Layer(nnx.Module):
  """The head's decoder layer, split in two so that training can run its own attention:
  `project` (norms, q/k/v, rotary) and `finish` (o_proj, residual, MLP)."""

  def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
    d, h, kvh, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.hidden_norm = RMSNorm(d, cfg.norm_eps, offset=False, dtype=dtype)
    self.input_layernorm = RMSNorm(d, cfg.norm_eps, offset=False, dtype=dtype)
    self.self_attn = Eagle3Attention(d, h, kvh, hd, dtype=dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(d, cfg.norm_eps, offset=False, dtype=dtype)
    self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)
    self.n_heads, self.n_kv_heads, self.head_dim, self.theta = h, kvh, hd, cfg.rope_theta

  def project(self, emb, h, positions):
    """emb, h [B, T, D]; positions [B, T] -> q [B, T, H, hd], k, v [B, T, KVH, hd] (q, k rotated)."""
    x = jnp.concatenate([self.input_layernorm(emb), self.hidden_norm(h.astype(emb.dtype))], axis=-1)   # [B, T, 2D]
    qkv = self.self_attn.qkv_proj(x)                                           # [B, T, (H+2KVH)*hd]
    q, k, v = split_qkv(qkv, self.n_heads, self.n_kv_heads, self.head_dim)     # [B, T, H | KVH, hd]
    return rope(q, positions, self.theta), rope(k, positions, self.theta), v

  def finish(self, h, attn_out):
    """h [B, T, D] the residual input; attn_out [B, T, H, hd] -> h' [B, T, D] (pre-norm)."""
    b, t = h.shape[:2]
    x = h.astype(jnp.float32) + self.self_attn.o_proj(attn_out.reshape(b, t, -1))
    return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nnx.Module):
  def __init__(self, hc: Eagle3Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
    d = hc.target.d_model
    self.fc = Linear(3 * d, d, bias=False, dtype=dtype, rngs=rngs)
    self.midlayer = Eagle3Layer(hc.layer, dtype=dtype, rngs=rngs)
    self.norm = RMSNorm(d, hc.target.norm_eps, offset=False, dtype=dtype)
    self.lm_head = Linear(d, hc.draft_vocab, bias=False, dtype=dtype, rngs=rngs)
    self.scale = hc.layer.scale
    self.slots = hc.tap_slots

  def fuse(self, layer_taps):
    """The target's tapped hidden states (the decoder's tuple, [B, T, D] each) -> g [B, T, D]."""
    return self.fc(jnp.concatenate([layer_taps[s].astype(jnp.float32) for s in self.slots], axis=-1))

  def logits(self, h):
    """h' [B, T, D] -> draft-vocabulary logits [B, T, Vd] float32."""
    return self.lm_head(self.norm(h))


@functools.lru_cache(maxsize=None)
def head_graphdef(hc: Eagle3Config, dtype_name: str):
  return graphdef_of(lambda: Eagle3Head(hc, dtype=jnp.dtype(dtype_name), rngs=nnx.Rngs(0)))


def head_module(hp, hc: Eagle3Config) -> Eagle3Head:
  """The head as a module over parameters `hp` (a pure dict or nnx.State), inside a trace."""
  return nnx.merge(head_graphdef(hc, str(jax.tree_util.tree_leaves(hp)[0].dtype)), hp)


def init_head(hc: Eagle3Config, seed: int = 0, dtype=jnp.float32, *, target_params=None, d2t=None) -> dict:
  """Head parameters as a pure dict: matrices N(0, 1/d_in). With `target_params` and `d2t`, the
  final norm and LM head start as the target's own, restricted to the draft vocabulary."""
  pure = params_of(Eagle3Head(hc, dtype=dtype, rngs=nnx.Rngs(seed)))
  if target_params is not None:
    model = model_of(target_params, hc.target)
    w = model.embed_tokens.embedding[...] if model.lm_head is None else model.lm_head.kernel[...]     # [V, D]
    pure["lm_head"]["kernel"] = jnp.asarray(w[jnp.asarray(d2t)], dtype)                              # [Vd, D]
    pure["norm"]["weight"] = jnp.asarray(model.norm.weight[...], dtype)
  return pure


def head_step(hp, hc: Eagle3Config, emb, h, cache: KVCache, positions, n_new, visible=None):
  """Run T entries (emb, h [B, T, D]) through the head's layer with its one-layer KV cache: written
  at slots `lengths .. lengths+T-1`, rotary `positions` [B, T], committed up to `n_new` [B].
  `visible` [B, T, S] (trees) replaces the default mask (committed slots + causal among the new).
  Returns (h' [B, T, D] pre-norm, cache)."""
  layer = head_module(hp, hc).midlayer
  q, k, v = layer.project(emb, h, positions)
  k_all, v_all = cache.write(0, k, v)                                              # [B, S, KVH, hd]
  if visible is None:
    visible = attention_masks(hc.layer, cache.lengths, positions, cache.capacity)["full"]
  out = attend(q, k_all, v_all, visible, hc.layer.scale)                          # [B, T, H, hd]
  return layer.finish(h, out), KVCache(k=(k_all,), v=(v_all,), lengths=cache.lengths + jnp.asarray(n_new, jnp.int32))


# ----------------------------------------------------------------------------------------------
# the draft vocabulary


def build_d2t(token_rows, vocab_size: int, draft_vocab: int, always=()) -> np.ndarray:
  """The `draft_vocab` most frequent target tokens of `token_rows` (an iterable of int arrays),
  plus `always` (e.g. EOS ids) whatever their counts, ties to the smaller id; sorted ascending.
  Returns d2t [Vd] int32: draft token i is target token d2t[i]."""
  counts = np.zeros(vocab_size, np.int64)
  for row in token_rows:
    counts += np.bincount(np.asarray(row, np.int64), minlength=vocab_size)[:vocab_size]
  forced = sorted({int(t) for t in always if 0 <= int(t) < vocab_size})
  counts[forced] = np.iinfo(np.int64).max
  order = np.argsort(-counts, kind="stable")                                       # frequent first, ties by id
  return np.sort(order[:draft_vocab]).astype(np.int32)


def t2d_mask(d2t, vocab_size: int):
  """[V] bool: target tokens the draft vocabulary holds."""
  return jnp.zeros((vocab_size,), bool).at[jnp.asarray(d2t)].set(True)


# ----------------------------------------------------------------------------------------------
# saving and loading: bf16 safetensors (EAGLE-3 tensor names, [out, in]) + a JSON config. EAGLE-3
# names its tensors as HF does (`weights.hf_names`): `fc.weight`, `midlayer.self_attn.q_proj.weight`,
# `midlayer.mlp.gate_proj.weight`, `norm.weight`, `lm_head.weight`; fused projections as their parts.


def head_paths(path: str | Path) -> tuple[Path, Path]:
  """(weights, config): `X.safetensors` + `X.json`, or a directory with `eagle3_head.*`."""
  return head_file.head_paths(path, FORMAT)


def head_tensors(hp, d2t, hc: Eagle3Config, dtype="bfloat16") -> dict:
  """The file tensors of a head: its weights as `dtype` under EAGLE-3's names ([out, in], fused
  projections split), `d2t` in EAGLE-3's offset form (target id - draft id, int64) and `t2d`
  (bool [V])."""
  flat = tensors_from(params_of(hp), hf_names, fused_sizes(hc.layer), dtype=dtype)
  d2t = np.asarray(d2t, np.int64)
  flat["d2t"] = d2t - np.arange(len(d2t), dtype=np.int64)
  flat["t2d"] = np.asarray(t2d_mask(d2t, hc.target.vocab_size))
  return flat


def save_head(path: str | Path, hp, d2t, hc: Eagle3Config, *, dtype="bfloat16", extra: dict | None = None):
  """Write the head (`head_tensors`) as safetensors and a JSON config (target config, head shape,
  `extra`)."""
  config = {"dtype": str(jnp.dtype(dtype)), "draft_vocab": hc.draft_vocab, "ffn_dim": hc.ffn_dim,
            "tap_layers": list(hc.tap_layers), "target_config": dataclasses.asdict(hc.target), **(extra or {})}
  return head_file.save_head(path, FORMAT, head_tensors(hp, d2t, hc, dtype), config)


def read_head_tensors(flat: dict, hc: Eagle3Config, what: str, dtype=None) -> tuple[dict, np.ndarray]:
  """(head params, d2t [Vd] int32) from the file tensors of a head of shape `hc` (this layout or
  the reference one: the same names); a file without `d2t` drafts over the first Vd ids."""
  flat = dict(flat)
  d2t = (flat.pop("d2t") + np.arange(hc.draft_vocab)).astype(np.int32) if "d2t" in flat \
      else np.arange(hc.draft_vocab, dtype=np.int32)
  flat.pop("t2d", None)
  abstract = abstract_params(lambda: Eagle3Head(hc, rngs=nnx.Rngs(0)))
  pure, used = params_from_tensors(abstract, flat, hf_names, what=what, dtype=dtype)
  refuse_unplaced(flat, used, what)
  return pure, d2t


def load_head(path: str | Path, cfg: ModelConfig, dtype=None) -> tuple[dict, np.ndarray, Eagle3Config, dict]:
  """(head params as a pure dict, d2t [Vd] int32, its Eagle3Config, JSON config) for target `cfg`;
  refuses a head trained for a target of other sizes. A folder in the reference layout (the EAGLE
  code / SpecForge / SGLang / vLLM: `config.json` + safetensors) loads too."""
  from specjax.drafters.eagle3_reference import is_reference_folder, load_reference
  if is_reference_folder(path):
    return load_reference(path, cfg, dtype)
  flat, meta, wpath = head_file.load_head(path, FORMAT)
  check_target(meta, cfg, ("arch", "vocab_size", "d_model", "n_heads", "n_kv_heads", "head_dim", "n_layers"),
               f"EAGLE-3 head {wpath}")
  hc = Eagle3Config.make(cfg, meta["draft_vocab"], meta["ffn_dim"], meta["tap_layers"])
  pure, d2t = read_head_tensors(flat, hc, f"EAGLE-3 head {wpath}", dtype)
  return pure, d2t, hc, meta
