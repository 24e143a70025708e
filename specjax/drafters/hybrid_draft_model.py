"""`draft` for hybrid models: a (smaller) hybrid draft model with the target's vocabulary.

Like `specjax.drafters.draft_model.DraftModelDrafter`, plus a rollback of the draft model's own
recurrent state: it keeps its state after each token it fed while drafting and `commit` picks the
one at the accepted length (the `per_step` rollback, on the drafter's side). The target, hybrid or
not, runs in the engine (`speculative_generate(..., rollback="per_step" | "redecode")`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.drafters.base import DeviceDrafter, Draft, DraftContext, RoundResult
from specjax.drafters.draft_model import catch_up_window, pick_greedy
from specjax.models.hybrid import hybrid_forward
from specjax.models.recurrent_state import HybridState, pick_step


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridDraftState:
  state: HybridState          # the draft model's state after proposing
  conv_steps: tuple          # per recurrent layer [B, K, K-1, C]: conv state after `last`, d1, .., d_{K-1}
  rec_steps: tuple           # per recurrent layer [B, K, Hv, Dk, Dv]: recurrent state after the same
  base: jax.Array             # [B] target length when the current draft was made
  end: jax.Array              # [B] draft length after proposing


@dataclasses.dataclass(frozen=True)
class HybridDraftModelDrafter(DeviceDrafter):
  """Device drafter backed by a (smaller) hybrid model with the target's vocabulary.

  Same contract as `DraftModelDrafter`: before `propose` the draft state holds every committed
  token except the newest one or two, which it feeds first (2-token window), then drafts greedily
  one token per step until p_min / n_max. It keeps its state after each fed token; `commit` picks
  the one at the accepted length (per-step rollback of the draft's own recurrent state)."""
  cfg: Any
  max_draft: int = 8
  weights: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
  name: str = "draft"
  taps: tuple[int, ...] = ()

  def params(self):
    return self.weights

  def init(self, dparams, prompt_tokens, prompt_lens, prefill_taps, capacity: int) -> HybridDraftState:
    b = prompt_tokens.shape[0]
    state = HybridState.init(self.cfg, b, capacity, dtype=jax.tree_util.tree_leaves(dparams)[0].dtype)
    _, _, state = hybrid_forward(dparams, self.cfg, prompt_tokens, state, n_new=prompt_lens)
    rep = lambda xs: tuple(jnp.repeat(x[:, None], self.max_draft, 1) for x in xs)
    return HybridDraftState(state=state, conv_steps=rep(state.conv), rec_steps=rep(state.rec),
                            base=prompt_lens, end=prompt_lens)

  def propose(self, dparams, dstate: HybridDraftState, ctx: DraftContext) -> tuple[Draft, HybridDraftState]:
    b, k = ctx.last.shape[0], self.max_draft
    window, missing = catch_up_window(ctx, dstate.state.lengths)
    logits, _, state = hybrid_forward(dparams, self.cfg, window, dstate.state, n_new=missing, last_only=True)
    tok0, conf0 = pick_greedy(logits)
    active0 = (conf0 >= ctx.p_min) & (ctx.n_max > 0)

    def step(carry, i):   # one drafted token per step; the body compiles once (a scan, not unrolled)
      state, prev, active, lengths = carry
      logits, _, state = hybrid_forward(dparams, self.cfg, prev[:, None], state)
      tok, conf = pick_greedy(logits)
      active = active & (conf >= ctx.p_min) & (i < ctx.n_max)
      return (state, tok, active, lengths + active.astype(jnp.int32)), (tok, state.conv, state.rec)

    carry = (state, tok0, active0, active0.astype(jnp.int32))
    (last_state, _, _, lengths), (toks, convs, recs) = jax.lax.scan(step, carry, jnp.arange(1, k))
    steps = lambda first, rest: tuple(jnp.concatenate([f[:, None], jnp.moveaxis(r, 0, 1)], axis=1)
                                      for f, r in zip(first, rest))           # [B, K, ...]
    new = HybridDraftState(state=last_state, conv_steps=steps(state.conv, convs), rec_steps=steps(state.rec, recs),
                           base=ctx.target_len, end=last_state.lengths)
    tokens = jnp.concatenate([tok0[:, None], toks.T], axis=1)                     # [B, K]
    return Draft(tokens=tokens, lengths=lengths), new

  def commit(self, dparams, dstate: HybridDraftState, result: RoundResult) -> HybridDraftState:
    committed = dstate.base + 1 + jnp.where(result.live, result.n_accepted, 0)
    length = jnp.minimum(committed, dstate.end)                                   # in [base+1, base+K]
    i = length - dstate.base - 1
    pick = lambda x: pick_step(x, i)
    state = HybridState(kv=dstate.state.kv.with_lengths(length), conv=tuple(map(pick, dstate.conv_steps)),
                        rec=tuple(map(pick, dstate.rec_steps)))
    return dataclasses.replace(dstate, state=state)
