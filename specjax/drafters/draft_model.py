"""`draft`: a smaller model with the target's vocabulary drafts greedily, stopping below p_min.

The draft model keeps its own KV cache (a pytree in the drafter state). Invariant between
rounds: the draft cache holds every committed token except at most the newest one or two, which
`propose` feeds first (a 2-token window with a per-sequence count), then drafts one token per
step. `commit` rolls the draft cache back to what the target accepted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.drafters.base import DeviceDrafter, Draft, DraftContext, RoundResult
from specjax.errors import UserError
from specjax.models.config import ModelConfig
from specjax.models.decoder import forward
from specjax.models.kv_cache import KVCache


class IncompatibleDraftError(UserError):
  """Draft and target cannot share tokens (llama.cpp's compatibility rules)."""


VOCAB_SIZE_TOLERANCE = 128      # llama.cpp SPEC_VOCAB_MAX_SIZE_DIFFERENCE
VOCAB_CHECK_START = 5           # llama.cpp SPEC_VOCAB_CHECK_START_TOKEN_ID


def check_compatible(target_tok, draft_tok) -> None:
  """Refuse a draft/target pair under llama.cpp's rules: vocab type, BOS/EOS flags and ids,
  vocabulary sizes within 128, identical token text for every id from 5 up."""
  problems = []
  if target_tok.model_type != draft_tok.model_type:
    problems.append(f"vocab type differs: target {target_tok.model_type}, draft {draft_tok.model_type}")
  for attr in ("add_bos", "add_eos", "bos_id", "eos_id"):
    a, b = getattr(target_tok, attr), getattr(draft_tok, attr)
    if a != b:
      problems.append(f"{attr} differs: target {a}, draft {b}")
  nt, nd = target_tok.vocab_size, draft_tok.vocab_size
  if abs(nt - nd) > VOCAB_SIZE_TOLERANCE:
    problems.append(f"vocabulary sizes differ by {abs(nt - nd)} (> {VOCAB_SIZE_TOLERANCE}): target {nt}, draft {nd}")
  else:
    for i in range(VOCAB_CHECK_START, min(nt, nd)):
      if target_tok.token_text(i) != draft_tok.token_text(i):
        problems.append(f"token {i} differs: target {target_tok.token_text(i)!r}, draft {draft_tok.token_text(i)!r}")
        break
  if problems:
    raise IncompatibleDraftError("draft model is not compatible with the target: " + "; ".join(problems))


def catch_up_window(ctx: DraftContext, draft_lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The committed tokens a draft model's state lacks: history[Ld .. Lt] (1 or 2 tokens, `last`
  included: the round's bonus token, and the last accepted draft token when every draft was
  accepted). -> (window [B, 2], how many of it are new [B])."""
  missing = ctx.target_len + 1 - draft_lengths                                    # [B] in {1, 2}
  cols = draft_lengths[:, None] + jnp.arange(2)[None, :]
  window = jnp.take_along_axis(ctx.history, jnp.minimum(cols, ctx.history.shape[1] - 1), axis=1)   # [B, 2]
  return window, missing


def pick_greedy(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """logits [B, 1, V] -> (argmax token [B], its probability [B]: the confidence p_min is compared with)."""
  probs = jax.nn.softmax(logits[:, 0].astype(jnp.float32), axis=-1)               # [B, V]
  return jnp.argmax(probs, axis=-1).astype(jnp.int32), jnp.max(probs, axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftModelState:
  cache: KVCache              # draft model's KV cache
  base: jax.Array             # [B] target length when the current draft was made
  end: jax.Array              # [B] draft cache length after proposing


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter(DeviceDrafter):
  """Device drafter backed by a smaller model. Hashable by its static configuration."""
  cfg: ModelConfig
  max_draft: int = 8
  weights: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
  unroll: bool = True          # draft steps unrolled (no per-step loop condition read by the host);
                               # False: a while_loop of single steps that stops once every sequence
                               # stopped drafting (as blocks of 1)
  block: int = 4               # unrolled: with more than `block` steps after the first token, the
                               # rest run as blocks of `block` unrolled steps in a while_loop that
                               # stops once every sequence stopped (below p_min or at its n_max),
                               # one condition read a block; 0: every step unrolled
  name: str = "draft"
  taps: tuple[int, ...] = ()
  kv_on_model: bool = False      # KV caches split over "model" (set by `parallel.place_drafter`)

  def params(self):
    return self.weights

  def init(self, dparams, prompt_tokens, prompt_lens, prefill_taps, capacity: int) -> DraftModelState:
    b = prompt_tokens.shape[0]
    cache = KVCache.init(self.cfg, b, capacity, dtype=jax.tree_util.tree_leaves(dparams)[0].dtype)
    _, _, cache = forward(dparams, self.cfg, prompt_tokens, cache, n_new=prompt_lens)
    return DraftModelState(cache=cache, base=prompt_lens, end=prompt_lens)

  def propose(self, dparams, dstate: DraftModelState, ctx: DraftContext) -> tuple[Draft, DraftModelState]:
    b, k = ctx.last.shape[0], self.max_draft
    window, missing = catch_up_window(ctx, dstate.cache.lengths)
    logits, _, cache = forward(dparams, self.cfg, window, dstate.cache, n_new=missing, last_only=True)
    tok0, conf0 = pick_greedy(logits)
    active0 = (conf0 >= ctx.p_min) & (ctx.n_max > 0)
    tokens0 = jnp.zeros((b, k), jnp.int32).at[:, 0].set(tok0)
    lengths0 = active0.astype(jnp.int32)

    def cond(c):
      i, _, _, active, _ = c
      return (i < k) & jnp.any(active)

    def body(c):
      i, cache, tokens, active, lengths = c
      prev = jnp.take_along_axis(tokens, (i - 1)[None, None].repeat(b, 0), axis=1)   # [B, 1]
      logits, _, cache = forward(dparams, self.cfg, prev, cache)
      tok, conf = pick_greedy(logits)
      active = active & (conf >= ctx.p_min) & (i < ctx.n_max)
      tokens = tokens.at[:, i].set(tok)
      return i + 1, cache, tokens, active, lengths + active.astype(jnp.int32)

    carry = (jnp.int32(1), cache, tokens0, active0, lengths0)
    steps, block = k - 1, self.block if self.unroll else 1     # no unrolling: blocks of one step
    if block <= 0 or steps <= block:
      for _ in range(steps):
        carry = body(carry)
    else:
      # the first steps % block unrolled, then whole blocks: the loop never runs past step k - 1
      for _ in range(steps % block):
        carry = body(carry)

      def block_body(c):
        for _ in range(block):
          c = body(c)
        return c
      carry = jax.lax.while_loop(cond, block_body, carry)
    _, cache, tokens, _, lengths = carry
    new_state = DraftModelState(cache=cache, base=ctx.target_len, end=cache.lengths)
    return Draft(tokens=tokens, lengths=lengths), new_state

  def commit(self, dparams, dstate: DraftModelState, result: RoundResult) -> DraftModelState:
    committed = dstate.base + jnp.where(result.live, 1 + result.n_accepted, 0)
    return dataclasses.replace(dstate, cache=dstate.cache.with_lengths(jnp.minimum(committed, dstate.end)))
