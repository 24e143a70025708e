"""A tiny random model with a byte tokenizer, for notebooks and tests of the tuner."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
  """UTF-8 bytes are tokens 0..255, 256 ends a text: the tokenizer of `tiny_target`."""

  vocab_size = 257
  eos_ids = (256,)

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def encode_chat(self, messages) -> list[int]:
    return self.encode("".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>")

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", "replace")


def tiny_target(seed: int = 2, d_model: int = 64, n_layers: int = 2):
  """A tiny llama with random weights and a byte tokenizer (a `LoadedModel`): generation and
  compilation take seconds on a CPU. Weights are drawn so that logits are O(1) and well separated
  (embeddings N(0, 1), kernels N(0, 1/d_in), norms near 1): greedy answers soon fall into loops,
  which n-gram drafters pick up, a stand-in for the repetition of real answers."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from specjax.models.config import ModelConfig
  from specjax.models.decoder import Transformer
  from specjax.models.load import LoadedModel
  cfg = ModelConfig(arch="llama", vocab_size=ByteTokenizer.vocab_size, d_model=d_model, n_layers=n_layers,
                    n_heads=4, n_kv_heads=2, head_dim=d_model // 4, ffn_dim=2 * d_model, rope_theta=10000.0,
                    norm_eps=1e-6)
  _, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    last = str(getattr(path[-1], "key", getattr(path[-1], "idx", path[-1])))
    if last == "embedding":
      x = rng.standard_normal(leaf.shape)
    elif last == "kernel":                       # [out, in], drawn as [in, out]
      x = rng.standard_normal(leaf.shape[::-1]).T * leaf.shape[1] ** -0.5
    elif last == "bias":
      x = 0.1 * rng.standard_normal(leaf.shape)
    else:                                          # norm weights
      x = 1.0 + 0.1 * rng.standard_normal(leaf.shape)
    return jnp.asarray(x, jnp.float32)

  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state)))
  return LoadedModel(name="tiny-random", cfg=cfg, params=state, tokenizer=ByteTokenizer(), source="random")
