"""Speculative decoding on hybrid (attention + recurrent) targets, lossless in both rollback modes.

The engine's loop (`specjax.engine`) is written against a KV cache: verification writes K+1
tokens, acceptance rolls back by length. A recurrent target also needs its conv / recurrent state
at the accepted position. `Target` objects say how a target family initialises, runs, verifies
and commits its state:

- `DecoderTarget`: `decoder.forward`, rollback by length (what `specjax.engine` does inline).
- `HybridTarget(rollback="per_step")`: verification returns the state after each of the K+1
  positions, the commit picks one (`rollback_per_step`): K+1 recurrent states of memory.
- `HybridTarget(rollback="redecode")`: the commit keeps the state from before verification and,
  for sequences that rejected a draft, re-runs the accepted tokens from it (`rollback_redecode`):
  one extra state, a second pass on partial acceptance.

The loop state (`GenState`: model state, history, sampler keys, done flags) is one pytree and a
round is `state -> state`: the sampler's state (keys, and the history any penalty would read)
is committed together with the model state, for exactly the emitted tokens. So sampling with
speculation has the law of sampling without it (tested with the engine's chi-square test).

The loop functions below mirror `specjax.engine` / `specjax.decode` with the target made a static
argument (interim: once the engine asks a `target_of(cfg, rollback)` for verify / commit, they go
and `DecoderTarget` moves next to `decoder.forward`); `HybridDraftModelDrafter` is the draft-model
drafter for a hybrid draft model (it rolls its own recurrent state back with per-step states of
its drafting steps; its place is `specjax/drafters/`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decode import DecodeResult
from specjax.drafters.base import Draft, DraftContext, DraftParams, RoundResult
from specjax.engine import SpecResult
from specjax.generation import GenState, emit, outputs_of, pad_prompts, plan_capacity
from specjax.models import decoder
from specjax.models.hybrid import HybridConfig, HybridTarget, hybrid_forward
from specjax.recurrent_state import HybridState, pick_step
from specjax.sampling import SamplingParams, init_keys, sample, shaped_probs, split_keys
from specjax.state import KVCache
from specjax.stats import RoundStats, SpecStats
from specjax.verify import accept_drafts

# ----------------------------------------------------------------------------------------------
# target families: init / forward / verify / commit


@dataclasses.dataclass(frozen=True)
class DecoderTarget:
  """Attention-only targets: the KV cache is the whole state; rollback is by length."""

  def init_state(self, cfg, batch: int, capacity: int, dtype) -> KVCache:
    return KVCache.init(cfg, batch, capacity, dtype=dtype)

  def forward(self, params, cfg, tokens, state, **kw):
    return decoder.forward(params, cfg, tokens, state, **kw)

  def verify(self, params, cfg, tokens, state, *, taps=()):
    logits, tapped, after = decoder.forward(params, cfg, tokens, state, taps=taps)
    return logits, tapped, after, None

  def commit(self, params, cfg, tokens, before, after, ckpt, n_keep):
    return after.with_lengths(before.lengths + n_keep)


def target_of(cfg, rollback: str = "per_step"):
  return HybridTarget(rollback) if isinstance(cfg, HybridConfig) else DecoderTarget()


# ----------------------------------------------------------------------------------------------
# plain decoding (the baseline)


def prefill(params, cfg, target, tokens, prompt_lens, sampling: SamplingParams, stop_ids, max_new,
            capacity: int, history_len: int, taps=()):
  """`specjax.generation.prefill` for any target family."""
  b, t = tokens.shape
  state0 = target.init_state(cfg, b, capacity, jax.tree_util.tree_leaves(params)[0].dtype)
  logits, tapped, mstate = target.forward(params, cfg, tokens, state0, n_new=prompt_lens, taps=taps, last_only=True)
  keys, use = split_keys(init_keys(sampling))
  first = sample(shaped_probs(logits, sampling)[:, 0], use)                       # [B]
  history = jnp.zeros((b, history_len), jnp.int32).at[:, :t].set(tokens)
  state = GenState(cache=mstate, history=history, hist_len=prompt_lens, prompt_len=prompt_lens,
                   last=first, keys=keys, done=jnp.zeros((b,), bool))
  state, _ = emit(state, first[:, None], jnp.ones((b,), jnp.int32), stop_ids, max_new)
  return state, tapped


def decode_step(params, cfg, target, state: GenState, sampling, stop_ids, max_new) -> GenState:
  """One token per live sequence (recurrent form on hybrid targets)."""
  live = (~state.done).astype(jnp.int32)
  logits, _, mstate = target.forward(params, cfg, state.last[:, None], state.cache, n_new=live)
  keys, use = split_keys(state.keys)
  token = sample(shaped_probs(logits, sampling)[:, 0], use)
  state = dataclasses.replace(state, cache=mstate, keys=keys)
  state, _ = emit(state, token[:, None], live, stop_ids, max_new)
  return state


@functools.partial(jax.jit, static_argnames=("cfg", "target", "capacity", "history_len"))
def prefill_jit(params, tokens, prompt_lens, sampling, stop_ids, max_new, *, cfg, target, capacity, history_len):
  return prefill(params, cfg, target, tokens, prompt_lens, sampling, stop_ids, max_new, capacity, history_len)[0]


@functools.partial(jax.jit, static_argnames=("cfg", "target"), donate_argnames=("state",))
def _decode_loop(params, state, sampling, stop_ids, max_new, *, cfg, target):
  body = lambda s: decode_step(params, cfg, target, s, sampling, stop_ids, max_new)
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)


def generate_plain_hybrid(params, cfg, prompts: list[list[int]], *, max_new_tokens: int = 128,
                          sampling: SamplingParams | None = None, stop_ids=(),
                          capacity: int | None = None) -> DecodeResult:
  """Autoregressive generation (prefill in the chunked form, then one recurrent step per token)."""
  tokens, lens = pad_prompts(prompts)
  b = len(prompts)
  sampling = sampling or SamplingParams.make(b)
  cap = plan_capacity(tokens.shape[1], max_new_tokens, 0, capacity)
  max_new = jnp.full((b,), max_new_tokens, jnp.int32)
  stop = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
  history_len = cap      # as long as the cache: plain and speculative runs share one prefill program
  target = target_of(cfg)
  t0 = time.perf_counter()
  state = prefill_jit(params, jnp.asarray(tokens), jnp.asarray(lens), sampling, stop, max_new,
                      cfg=cfg, target=target, capacity=cap, history_len=history_len)
  state = _decode_loop(params, state, sampling, stop, max_new, cfg=cfg, target=target)
  jax.block_until_ready(state.hist_len)
  dt = time.perf_counter() - t0
  outs = outputs_of(state)
  return DecodeResult(tokens=outs, seconds=dt, n_generated=sum(len(o) for o in outs))


# ----------------------------------------------------------------------------------------------
# speculation


def verify_and_accept(params, cfg, target, state: GenState, draft: Draft, dp: dict, sampling: SamplingParams,
                      stop_ids, max_new, taps=()):
  """`specjax.engine.verify_and_accept` with the target's verify / commit in place of forward and
  rollback by length. The model state and the sampler state advance together by the emitted tokens."""
  b, k = draft.tokens.shape
  live = ~state.done
  dlen = jnp.minimum(draft.lengths, dp["n_max"])
  dlen = jnp.where((dlen < dp["n_min"]) | ~live, 0, dlen)
  verified = jnp.concatenate([state.last[:, None], draft.tokens], axis=1)          # [B, K+1]
  logits, tapped, after, ckpt = target.verify(params, cfg, verified, state.cache, taps=taps)
  p = shaped_probs(logits, sampling)
  keys, use = split_keys(state.keys)
  n_acc, nxt = accept_drafts(p, draft.tokens, dlen, use, draft.q)
  n_acc = jnp.where(live, n_acc, 0)
  mstate = target.commit(params, cfg, verified, state.cache, after, ckpt, jnp.where(live, 1 + n_acc, 0))
  idx = jnp.arange(k + 1)[None, :]
  emitted = jnp.where(idx == n_acc[:, None], nxt[:, None],
                      jnp.concatenate([draft.tokens, jnp.zeros((b, 1), jnp.int32)], axis=1))   # [B, K+1]
  state = dataclasses.replace(state, cache=mstate, keys=keys)
  state, n_out = emit(state, emitted, jnp.where(live, n_acc + 1, 0), stop_ids, max_new)
  return state, n_acc, nxt, dlen, verified, tapped, live, n_out


def _round(params, dparams, cfg, target, drafter, sampling, dp, stop_ids, max_new, carry):
  state, dstate, stats = carry
  ctx = DraftContext(last=state.last, history=state.history, hist_len=state.hist_len,
                     target_len=state.cache.lengths, n_max=jnp.where(state.done, 0, dp["n_max"]), p_min=dp["p_min"],
                     temperature=sampling.temperature)
  draft, dstate = drafter.propose(dparams, dstate, ctx)
  state, n_acc, nxt, dlen, verified, tapped, live, n_out = verify_and_accept(
      params, cfg, target, state, draft, dp, sampling, stop_ids, max_new, taps=drafter.taps)
  result = RoundResult(n_accepted=n_acc, next_token=nxt, verified=verified, prenorm=tapped["prenorm"],
                       layer_taps=tapped["layers"], live=live)
  dstate = drafter.commit(dparams, dstate, result)
  return state, dstate, stats.update(dlen, n_acc, live, n_out)


@functools.partial(jax.jit, static_argnames=("cfg", "target", "drafter", "capacity", "history_len"))
def _spec_prefill(params, dparams, tokens, prompt_lens, sampling, stop_ids, max_new, *,
                  cfg, target, drafter, capacity, history_len):
  state, tapped = prefill(params, cfg, target, tokens, prompt_lens, sampling, stop_ids, max_new, capacity,
                          history_len, taps=drafter.taps)
  return state, drafter.init(dparams, tokens, prompt_lens, tapped, capacity)


@functools.partial(jax.jit, static_argnames=("drafter", "capacity"))
def _drafter_init(dparams, tokens, prompt_lens, *, drafter, capacity):
  return drafter.init(dparams, tokens, prompt_lens, {"prenorm": None, "layers": ()}, capacity)


@functools.partial(jax.jit, static_argnames=("cfg", "target", "drafter"), donate_argnames=("state", "dstate"))
def _spec_loop(params, dparams, state, dstate, sampling, dp, stop_ids, max_new, *, cfg, target, drafter):
  stats = RoundStats.zeros(state.last.shape[0], drafter.max_draft)
  body = functools.partial(_round, params, dparams, cfg, target, drafter, sampling, dp, stop_ids, max_new)
  return jax.lax.while_loop(lambda c: ~jnp.all(c[0].done), body, (state, dstate, stats))


@functools.partial(jax.jit, static_argnames=("cfg", "target"), donate_argnames=("state",))
def _host_round(params, state, stats, draft_tokens, draft_lengths, sampling, dp, stop_ids, max_new, *, cfg, target):
  draft = Draft(tokens=draft_tokens, lengths=draft_lengths)
  hl_before = state.hist_len
  state, n_acc, _, dlen, _, _, live, n_out = verify_and_accept(params, cfg, target, state, draft, dp, sampling,
                                                               stop_ids, max_new)
  cols = hl_before[:, None] + jnp.arange(draft_tokens.shape[1] + 1)[None, :]
  new_tokens = jnp.take_along_axis(state.history, jnp.minimum(cols, state.history.shape[1] - 1), axis=1)
  return state, stats.update(dlen, n_acc, live, n_out), n_acc, dlen, new_tokens, n_out, state.done


def speculative_generate_hybrid(params, cfg, prompts: list[list[int]], drafter, *, rollback: str = "per_step",
                                max_new_tokens: int = 128, sampling: SamplingParams | None = None,
                                draft_params: DraftParams | None = None, stop_ids=(),
                                capacity: int | None = None) -> SpecResult:
  """`specjax.engine.speculative_generate` on a hybrid (or any) target, with the rollback mode
  "per_step" or "redecode" for the target's recurrent state."""
  tokens, lens = pad_prompts(prompts)
  b, k = len(prompts), drafter.max_draft
  target = target_of(cfg, rollback)
  sampling = sampling or SamplingParams.make(b)
  dp = {n: jnp.asarray(a) for n, a in (draft_params or DraftParams(n_max=k)).arrays(b, k).items()}
  cap = plan_capacity(tokens.shape[1], max_new_tokens, k + 1, capacity)
  stop = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
  max_new = jnp.full((b,), max_new_tokens, jnp.int32)
  history_len = cap
  t0 = time.perf_counter()
  if drafter.on_device:
    dparams = drafter.params()
    tokens, lens = jnp.asarray(tokens), jnp.asarray(lens)
    if drafter.taps:
      state, dstate = _spec_prefill(params, dparams, tokens, lens, sampling, stop, max_new, cfg=cfg,
                                    target=target_of(cfg), drafter=drafter, capacity=cap, history_len=history_len)
    else:   # the plain prefill program (one compilation per capacity, whatever the drafter and rollback)
      state = prefill_jit(params, tokens, lens, sampling, stop, max_new, cfg=cfg, target=target_of(cfg),
                          capacity=cap, history_len=history_len)
      dstate = _drafter_init(dparams, tokens, lens, drafter=drafter, capacity=cap)
    state, dstate, stats = _spec_loop(params, dparams, state, dstate, sampling, dp, stop, max_new,
                                      cfg=cfg, target=target, drafter=drafter)
    if hasattr(drafter, "end_device"):
      drafter.end_device(dstate)     # drafters with cross-request memory by design (ngram_mod's table)
    jax.block_until_ready(state.hist_len)
    seconds, draft_seconds = time.perf_counter() - t0, 0.0
  else:
    state, stats, draft_seconds = _host_loop(params, cfg, target, drafter, prompts, tokens, lens, sampling, dp,
                                             stop, max_new, cap, history_len)
    seconds = time.perf_counter() - t0
  return SpecResult(tokens=outputs_of(state), seconds=seconds,
                    stats=SpecStats.from_rounds(drafter.name, stats, b, seconds, draft_seconds))


def _host_loop(params, cfg, target, drafter, prompts, tokens, lens, sampling, dp, stop, max_new, cap, history_len):
  b, k = len(prompts), drafter.max_draft
  state = prefill_jit(params, jnp.asarray(tokens), jnp.asarray(lens), sampling, stop, max_new,
                      cfg=cfg, target=target_of(cfg), capacity=cap, history_len=history_len)
  stats = RoundStats.zeros(b, k)
  first = np.asarray(state.last)
  histories = [list(p) + [int(first[i])] for i, p in enumerate(prompts)]
  done = np.asarray(state.done)
  n_max = np.asarray(dp["n_max"])
  drafter.begin([list(p) for p in prompts])
  draft_seconds = 0.0
  takes_verified = "verified" in inspect.signature(drafter.accept).parameters
  while not done.all():
    t0 = time.perf_counter()
    d_tok, d_len, _ = drafter.propose(histories, np.where(done, 0, n_max))
    draft_seconds += time.perf_counter() - t0
    d_len = np.minimum(np.asarray(d_len, np.int32), n_max)
    width = min(k, 1 << int(max(int(d_len.max()), 1) - 1).bit_length())       # power-of-two verify widths
    d_tok = np.asarray(d_tok, np.int32).reshape(b, -1)[:, :width]
    state, stats, n_acc, dlen, new_tokens, n_new, done_dev = _host_round(
        params, state, stats, jnp.asarray(d_tok), jnp.asarray(d_len), sampling, dp, stop, max_new,
        cfg=cfg, target=target)
    n_acc, dlen, new_tokens, n_new, done = (np.asarray(x) for x in (n_acc, dlen, new_tokens, n_new, done_dev))
    t0 = time.perf_counter()
    if takes_verified:
      drafter.accept(n_acc, verified=dlen > 0)
    else:
      drafter.accept(n_acc)
    for i in range(b):
      histories[i].extend(new_tokens[i, : n_new[i]].tolist())
    draft_seconds += time.perf_counter() - t0
  if hasattr(drafter, "end"):
    drafter.end(histories)
  return state, stats, draft_seconds


# ----------------------------------------------------------------------------------------------
# a hybrid draft model


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridDraftState:
  state: HybridState          # the draft model's state after proposing
  conv_steps: tuple          # per recurrent layer [B, K, K-1, C]: conv state after `last`, d1, .., d_{K-1}
  rec_steps: tuple           # per recurrent layer [B, K, Hv, Dk, Dv]: recurrent state after the same
  base: jax.Array             # [B] target length when the current draft was made
  end: jax.Array              # [B] draft length after proposing


@dataclasses.dataclass(frozen=True)
class HybridDraftModelDrafter:
  """Device drafter backed by a (smaller) hybrid model with the target's vocabulary.

  Same contract as `DraftModelDrafter`: before `propose` the draft state holds every committed
  token except the newest one or two, which it feeds first (2-token window), then drafts greedily
  one token per step until p_min / n_max. It keeps its state after each fed token; `commit` picks
  the one at the accepted length (per-step rollback of the draft's own recurrent state)."""
  cfg: Any
  max_draft: int = 8
  weights: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)
  name: str = "draft"
  on_device: bool = True
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
    state = dstate.state
    missing = ctx.target_len + 1 - state.lengths                                  # [B] in {1, 2}
    cols = state.lengths[:, None] + jnp.arange(2)[None, :]
    window = jnp.take_along_axis(ctx.history, jnp.minimum(cols, ctx.history.shape[1] - 1), axis=1)   # [B, 2]
    logits, _, state = hybrid_forward(dparams, self.cfg, window, state, n_new=missing, last_only=True)

    def pick(logits):
      probs = jax.nn.softmax(logits[:, 0].astype(jnp.float32), axis=-1)           # [B, V]
      return jnp.argmax(probs, axis=-1).astype(jnp.int32), jnp.max(probs, axis=-1)

    tok0, conf0 = pick(logits)
    active0 = (conf0 >= ctx.p_min) & (ctx.n_max > 0)

    def step(carry, i):   # one drafted token per step; the body compiles once (a scan, not unrolled)
      state, prev, active, lengths = carry
      logits, _, state = hybrid_forward(dparams, self.cfg, prev[:, None], state)
      tok, conf = pick(logits)
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
