"""Adaptive width-0 rounds as plain decoding steps, the drafter caught up once per chunk.

At width 0 (a chain of no drafts, a tree of no nodes) a round verifies `last` alone: one token a
round, as plain decoding, but through the round's machinery: the drafter's propose (a chain
drafter drafts its whole chain, then the round drops it), verification, for trees the path move,
the drafter's commit. `plain_chunks` runs such a stretch as plain decoding steps that keep the
target's taps (the hidden states a drafter conditions on) and catches the drafter up once per chunk
of up to `chunk_steps` steps as one round whose draft was the chunk's tokens, all accepted: before
the chunk the drafter does what its commit needs of a propose (`begin_chunk`: a tree at budget 0;
MTP / EAGLE-3 the committed root entry; DFlash the anchor's position), and commits after it with
the chunk's inputs [x_0 .. x_{m-1}] and their taps as the verified tokens, m - 1 of them accepted
and x_m (the new `last`) the bonus token. Drafters whose commit reads the verified tokens and taps
only (`chunk_commit`) are then where m width-0 rounds would leave them: EAGLE-3 and MTP write the
entries (g_j, x_{j+1}) each round would have written, DFlash appends the same features, the tree
draft model's next propose catches up the m tokens.

A chunk holds `PLAIN_CHUNK_STEPS` steps for drafters whose commit takes any number of verified tokens
(`long_chunks`), so the catch-up (a head forward and its launches, a fixed cost at small batch)
comes once per 32 steps rather than once per W+1 (W: a tree's depth or a chain's K), and W+1 for
the tree draft model, whose propose catches up at most that many new tokens.

The target's side is plain decoding's step (same forward, sampler keys and emission), so greedy
output is plain decoding's; sampled output is distributed as the target's, as in any round.

Shadow drafts (`shadow`): each chunk starts with the drafter's full draft (`shadow_propose`: a
chain at its full width, a tree at its full node budget) instead of `begin_chunk`, never verified
but compared with the tokens the chunk makes: what verifying it would have accepted (greedy
exactly; sampled, a point-mass draft matches the target's own sample with the probability
verification accepts it, a sampled draft somewhat less often). Adaptive drafting's estimates then
learn while backing off (`shadow_outcome` for chains; trees: `adaptive_tree.shadow_path`), so no
exploring rounds at the widest width are needed; the commit leaves the drafter as without the draft.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import parallel
from specjax.drafters.base import PLAIN_CHUNK_STEPS, Draft, RoundResult
from specjax.engine.decode import decode_step_tapped
from specjax.engine.round import Carry, RoundInputs, RoundSpec, commit_width, draft_context


def supports(spec: RoundSpec) -> bool:
  """Width-0 rounds of this spec may run as plain chunks: a device drafter whose commit takes them
  (`chunk_commit`; trees: `budgeted`, whose budget-0 propose drafts nothing). Commit-free drafters'
  width-0 rounds are plain steps already (`RoundSpec.plain`)."""
  d = spec.drafter
  return (spec.width == 0 and d is not None and d.on_device and d.chunk_commit and not d.commit_free
          and (d.budgeted or not d.proposes_tree))


def chunk_steps(spec: RoundSpec) -> int:
  """Plain steps per chunk: `PLAIN_CHUNK_STEPS`, or a round's verified tokens (W+1) for a drafter whose
  next propose catches up only that many (`long_chunks` off), or when they are more."""
  w = commit_width(spec)
  return max(w, PLAIN_CHUNK_STEPS) if spec.drafter.long_chunks else w


def shadow_outcome(draft: Draft, dp: dict, made, steps):
  """A shadow draft against the tokens a chunk made: (accepted [B], rejected [B], known [B]) as
  verification would have counted them (known: the draft positions the chunk made a token for).
  draft [B, K]; made [B, m] the chunk's tokens after `last` (row i's first steps[i] are real). Positions past a sequence's steps are unknown (censored, neither accepted nor
  rejected); a draft cut by n_min (or empty) where the sequence may draft counts as rejected at its
  first position, as an empty round does in the controller's totals."""
  dlen = jnp.minimum(draft.lengths, dp["n_max"])
  dlen = jnp.where(dlen < dp["n_min"], 0, dlen)                                     # [B] what would be verified
  n = min(draft.tokens.shape[1], made.shape[1])
  known = jnp.minimum(dlen, steps)                                                  # [B]
  same = (draft.tokens[:, :n] == made[:, :n]) & (jnp.arange(n)[None, :] < known[:, None])   # [B, n]
  accepted = jnp.sum(jnp.cumprod(same.astype(jnp.int32), axis=1), axis=1)
  rejected = (steps > 0) & (dp["n_max"] > 0) & ((accepted < known) | (dlen == 0))
  return accepted, rejected.astype(jnp.int32), known


def chain_shadow(dp: dict, batch: int):
  """`plain_chunks`' shadow for a chain drafter: the shadow drafts' totals (accepted [B], rejected [B])."""
  zeros = jnp.zeros((batch,), jnp.int32)

  def observe(seen, draft, made, steps, start):
    acc, rej, _ = shadow_outcome(draft, dp, made, steps)
    return seen[0] + acc, seen[1] + rej
  return (zeros, zeros), observe


def plain_chunks(spec: RoundSpec, inp: RoundInputs, rounds, carry: Carry, log_rounds: int = 0, shadow=None):
  """Up to `rounds` (traced) width-0 rounds of `spec` (`supports(spec)`) as plain decoding steps in
  chunks of up to `chunk_steps(spec)`, the drafter caught up after each.
  -> (carry, rounds each sequence was live in [B], rounds run []), and with `log_rounds` > 0
  (static; `rounds` <= it) the tokens each step emitted [log_rounds, B] (a server's per-round counts).
  With `shadow` = (seen, observe) each chunk starts with a shadow draft, `observe(seen, draft, made,
  steps, start) -> seen` reads it against the chunk's tokens (made [B, m]: the tokens after `last`, the
  first steps[i] of row i real; start []: the rounds run before the chunk), and the result ends with
  the last `seen` (chains: `chain_shadow`)."""
  drafter = spec.drafter
  chunk = chunk_steps(spec)
  b = carry.state.last.shape[0]
  full = dataclasses.replace(spec, width=None)                 # a shadow draft: the whole chain or tree
  step_tapped = lambda s: decode_step_tapped(inp.params, spec.cfg, s, inp.sampling, inp.stop_ids, inp.max_new,
                                             taps=spec.taps)
  taps_shape = jax.eval_shape(step_tapped, carry.state)[2]

  def zeros_like_taps(s):                                                        # [B, 1, d] -> [B, chunk, d]
    return jnp.zeros((b, chunk) + s.shape[2:], s.dtype)

  def chunk_body(c):
    carry, live_rounds, ran, log, seen = c
    n = jnp.minimum(rounds - ran, chunk)
    state = parallel.constrain_state(carry.state)            # under a mesh the loop state keeps its layout
    dstate = parallel.constrain_state(carry.dstate, b, kv_on_model=spec.drafter_kv_on_model)
    if shadow is not None:
      draft, dstate = drafter.shadow_propose(inp.dparams, dstate, draft_context(full, inp, state))
    else:
      dstate = drafter.begin_chunk(inp.dparams, dstate, draft_context(spec, inp, state))   # commit's needs, no draft
    bufs = dict(tokens=jnp.zeros((b, chunk), jnp.int32), prenorm=zeros_like_taps(taps_shape["prenorm"]),
                layers=tuple(zeros_like_taps(s) for s in taps_shape["layers"]))

    def step(s):
      state, stats, bufs, steps, i, log = s
      live = ~state.done
      put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), i, axis=1)
      tokens = put(bufs["tokens"], state.last[:, None])                             # the step's input
      state, n_out, tapped = step_tapped(state)
      bufs = dict(tokens=tokens, prenorm=put(bufs["prenorm"], tapped["prenorm"]),
                  layers=tuple(put(x, h) for x, h in zip(bufs["layers"], tapped["layers"])))
      zeros = jnp.zeros_like(n_out)
      stats = stats.update(zeros, zeros, live, n_out, n_verified=zeros)
      if log_rounds:
        log = log.at[jnp.minimum(ran + i, log_rounds - 1)].set(n_out.astype(jnp.int32))
      return state, stats, bufs, steps + live.astype(jnp.int32), i + 1, log

    state, stats, bufs, steps, i, log = jax.lax.while_loop(
        lambda s: (s[4] < n) & ~jnp.all(s[0].done), step,
        (state, carry.stats, bufs, jnp.zeros((b,), jnp.int32), jnp.int32(0), log))
    result = RoundResult(n_accepted=jnp.maximum(steps - 1, 0), next_token=state.last, verified=bufs["tokens"],
                         prenorm=bufs["prenorm"], layer_taps=bufs["layers"], live=steps > 0)
    dstate = drafter.commit(inp.dparams, dstate, result)
    if shadow is not None:   # the chunk's tokens after `last`: its inputs x_1 .. x_{i-1}, then the new `last` x_i
      made = jax.lax.dynamic_update_slice_in_dim(
          jnp.concatenate([bufs["tokens"], jnp.zeros((b, 1), jnp.int32)], axis=1), state.last[:, None], i, axis=1)
      seen = shadow[1](seen, draft, made[:, 1:], steps, ran)
    return Carry(state=state, dstate=dstate, stats=stats), live_rounds + steps, ran + i, log, seen

  log = jnp.zeros((max(log_rounds, 1), b), jnp.int32)
  seen = () if shadow is None else shadow[0]
  carry, live_rounds, ran, log, seen = jax.lax.while_loop(
      lambda c: (c[2] < rounds) & ~jnp.all(c[0].state.done), chunk_body,
      (carry, jnp.zeros((b,), jnp.int32), jnp.int32(0), log, seen))
  return (carry, live_rounds, ran) + ((log,) if log_rounds else ()) + ((seen,) if shadow is not None else ())
