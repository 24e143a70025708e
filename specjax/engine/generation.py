"""Generation state shared by plain decoding and the speculative engine: prefill and emission.

`GenState` is the loop state of every decode loop: the target's KV cache, the token history
(prompt + generated) per sequence, the last sampled token (not yet in the cache), the sampler's
keys and the done flags. `emit` appends a ragged block of new tokens per sequence, cut at the
first stop token and at the token budget.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.decoder import DecoderTarget
from specjax.models.hybrid import HybridTarget
from specjax.models.hybrid_config import HybridConfig
from specjax.models.recurrent_state import HybridState
from specjax.engine.sampling import SamplingParams, init_keys, next_token, split_keys
from specjax.models.kv_cache import KVCache, CacheOverflowError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenState:
  cache: KVCache | HybridState   # the target's state (`target_of(cfg)` says which)
  history: jax.Array        # [B, H] int32: prompt then generated tokens
  hist_len: jax.Array       # [B] int32: valid entries of history (includes `last`)
  prompt_len: jax.Array     # [B] int32
  last: jax.Array           # [B] int32: newest token, not yet in the KV cache
  keys: jax.Array           # [B, 2] uint32: sampler state
  done: jax.Array           # [B] bool

  @property
  def n_out(self) -> jax.Array:
    return self.hist_len - self.prompt_len


def target_of(cfg, rollback: str = "per_step"):
  """How the loops run the target of `cfg`: init / forward / verify / commit of its state.
  `rollback` ("per_step" | "redecode") applies to targets with recurrent state. With
  SPECJAX_FUSED_DECODE=1, decode and verification steps of attention-only targets run the fused
  Pallas layer (`models/fused_layer.py`; opt-in until it measures faster)."""
  if isinstance(cfg, HybridConfig):
    return HybridTarget(rollback)
  from specjax.models import fused_layer
  return fused_layer.FusedDecoderTarget() if fused_layer.enabled() else DecoderTarget()


PROMPT_BUCKET = 64   # prompt widths are padded to a multiple of this, so new lengths rarely recompile


def pad_prompts(prompts: list[list[int]], pad: int = 0, bucket: int = PROMPT_BUCKET) -> tuple[np.ndarray, np.ndarray]:
  """Right-pad ragged prompts -> (tokens [B, T], lengths [B]); T is rounded up to `bucket`."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token")
  t = round_up(max(len(p) for p in prompts), bucket)
  tokens = np.full((len(prompts), t), pad, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, : len(p)] = p
  return tokens, np.asarray([len(p) for p in prompts], np.int32)


def round_up(n: int, m: int = 128) -> int:
  return -(-n // m) * m


def plan_capacity(width: int, max_new: int, lookahead: int = 0, capacity: int | None = None) -> int:
  """Cache slots for padded prompt width + max_new + draft lookahead (a function of shapes only, so
  it adds no recompilation); a clear error if a given `capacity` is short."""
  need = width + max_new + lookahead + 1
  if capacity is None:
    return round_up(need)
  if need > capacity:
    raise CacheOverflowError(f"prompts padded to {width} tokens + {max_new} new tokens + {lookahead} draft "
                             f"lookahead need {need} cache slots, capacity is {capacity}")
  return capacity


def emit(state: GenState, tokens: jax.Array, n_emit: jax.Array, stop_ids: jax.Array,
         max_new: jax.Array) -> tuple[GenState, jax.Array]:
  """Append tokens [B, J] (the first n_emit [B] of each row) to the history.

  Emission stops after the first stop token and at the max_new budget; sequences already done
  emit nothing. Returns (state with history / last / done updated, emitted count [B]).
  """
  j = tokens.shape[1]
  idx = jnp.arange(j)[None, :]
  is_stop = jnp.isin(tokens, stop_ids) & (idx < n_emit[:, None])                  # [B, J]
  first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, j + 1)
  budget = max_new - state.n_out
  n = jnp.minimum(jnp.minimum(n_emit, first_stop), budget)
  n = jnp.where(state.done, 0, jnp.maximum(n, 0))                                  # [B]
  cols = state.hist_len[:, None] + idx                                             # [B, J]
  cols = jnp.where(idx < n[:, None], cols, state.history.shape[1])                 # out of range -> dropped
  # per row (vmap), so a history split over "data" is written on the device that holds the row
  history = jax.vmap(lambda h, c, x: h.at[c].set(x, mode="drop"))(state.history, cols, tokens)
  last = jnp.where(n > 0, jnp.take_along_axis(tokens, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0], state.last)
  hit_stop = (first_stop <= n) & (n > 0)
  done = state.done | hit_stop | (state.n_out + n >= max_new)
  new = dataclasses.replace(state, history=history, hist_len=state.hist_len + n, last=last, done=done)
  return new, n


def prefill(params, cfg, tokens, prompt_lens, sampling: SamplingParams, stop_ids, max_new,
            capacity: int, history_len: int, taps=()):
  """Run the prompts through the target and sample the first new token.

  tokens [B, T] right-padded, prompt_lens [B]. Returns (GenState, taps dict of the prompt pass).
  """
  b, t = tokens.shape
  target = target_of(cfg)
  cache = target.init_state(cfg, b, capacity, jax.tree_util.tree_leaves(params)[0].dtype)
  logits, tapped, cache = target.forward(params, cfg, tokens, cache, n_new=prompt_lens, taps=taps, last_only=True)
  keys, use = split_keys(init_keys(sampling))
  first = next_token(logits[:, 0], sampling, use)                                # [B]
  history = jnp.zeros((b, history_len), jnp.int32).at[:, :t].set(tokens)
  state = GenState(cache=cache, history=history, hist_len=prompt_lens, prompt_len=prompt_lens,
                   last=first, keys=keys, done=jnp.zeros((b,), bool))
  state, _ = emit(state, first[:, None], jnp.ones((b,), jnp.int32), stop_ids, max_new)
  return state, tapped


def outputs_of(state: GenState) -> list[list[int]]:
  """The generated tokens of each sequence (host lists)."""
  hist, hl, pl = (np.asarray(x) for x in (state.history, state.hist_len, state.prompt_len))
  return [hist[i, pl[i]:hl[i]].tolist() for i in range(hist.shape[0])]
