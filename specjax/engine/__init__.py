"""The speculative engine: draft -> verify -> accept, for a batch of sequences, lossless.

Device drafters run every round inside one jitted `lax.while_loop` (no host round trip per
round). Host drafters (n-gram maps, suffix trees) drive a host loop around one jitted
verify-and-accept step. Both use `verify_and_accept`, so verification is the same code. Device
drafters that propose token trees (`proposes_tree = True`, a `specjax.engine.tree.TreeDraft`) go through
`verify_tree_and_accept` instead, chosen statically.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.engine import adaptive as adapt
from specjax.engine.adaptive_replay import ReplayState, replay_segment
from specjax.drafters.base import Draft, DraftContext, DraftParams, RoundResult, check_drafter
from specjax.engine.decode import decode_step_counted, prefill_jit
from specjax.engine.generation import GenState, emit, outputs_of, pad_prompts, plan_capacity, prefill, target_of
from specjax.models.decoder import DecoderTarget
from specjax.engine.sampling import SamplingParams, shaped_probs, split_keys
from specjax.engine.stats import RoundStats, SpecStats
from specjax.engine.tree import TreeDraft, accept_tree, compact_path, max_depth_of, tree_attention_mask, tree_positions, tree_shape
from specjax.engine.verify import accept_drafts


def verify_and_accept(params, cfg, state: GenState, draft: Draft, dp: dict, sampling: SamplingParams,
                      stop_ids, max_new, taps=(), rollback: str = "per_step"):
  """Score [last, d1..dK] with the target, accept the longest acceptable prefix plus one token,
  roll the target's state back to the accepted length (KV: by length; recurrent state: `rollback`)
  and emit. Model state and sampler state advance together, by the emitted tokens only.
  Returns (state, n_acc, next, dlen, verified, taps)."""
  b, k = draft.tokens.shape
  live = ~state.done
  dlen = jnp.minimum(draft.lengths, dp["n_max"])
  dlen = jnp.where((dlen < dp["n_min"]) | ~live, 0, dlen)                          # short drafts are not verified
  verified = jnp.concatenate([state.last[:, None], draft.tokens], axis=1)          # [B, K+1]
  target = target_of(cfg, rollback)
  logits, tapped, after, ckpt = target.verify(params, cfg, verified, state.cache, taps=taps)   # [B, K+1, V]
  p = shaped_probs(logits, sampling)
  q = draft.q   # drafters shape q with the sequence's sampling parameters; None = one-hot
  keys, use = split_keys(state.keys)
  n_acc, nxt = accept_drafts(p, draft.tokens, dlen, use, q)
  n_acc = jnp.where(live, n_acc, 0)
  cache = target.commit(params, cfg, verified, state.cache, after, ckpt, jnp.where(live, 1 + n_acc, 0))
  idx = jnp.arange(k + 1)[None, :]
  emitted = jnp.where(idx == n_acc[:, None], nxt[:, None],
                      jnp.concatenate([draft.tokens, jnp.zeros((b, 1), jnp.int32)], axis=1))   # [B, K+1]
  state = dataclasses.replace(state, cache=cache, keys=keys)
  state, n_out = emit(state, emitted, jnp.where(live, n_acc + 1, 0), stop_ids, max_new)
  return state, n_acc, nxt, dlen, verified, tapped, live, n_out


def verify_tree_and_accept(params, cfg, state: GenState, tree: TreeDraft, dp: dict, sampling: SamplingParams,
                           stop_ids, max_new, max_depth: int, taps=()):
  """Score [last, node_0..node_{T-1}] with the target in one pass (tree positions and ancestor
  mask), accept the longest acceptable root-to-node path plus one token (`specjax.engine.tree`), move the
  path's KV entries into consecutive slots and emit. The node budget is dp["n_max"] (nodes past
  it are padding; trees under dp["n_min"] nodes are not verified).
  Returns (state, n_acc, next, n_nodes, depth reached, [last, path...] [B, D+1], taps along it,
  live, n_out)."""
  if not isinstance(target_of(cfg), DecoderTarget):
    raise NotImplementedError(
        "tree drafts are verified on attention-only targets; a hybrid target would need the recurrent "
        "state of every tree node (use a chain drafter with hybrid targets)")
  b, t = tree.tokens.shape
  live = ~state.done
  n_nodes = jnp.minimum(tree.n_nodes, dp["n_max"])
  n_nodes = jnp.where((n_nodes < dp["n_min"]) | ~live, 0, n_nodes)                 # [B]
  shape = tree_shape(tree.parents, n_nodes, max_depth)
  base = state.cache.lengths                                                        # [B] position of `last`
  verified = jnp.concatenate([state.last[:, None], tree.tokens], axis=1)           # [B, T+1]
  logits, tapped, after = target_of(cfg).forward(params, cfg, verified, state.cache, taps=taps,
                                                 positions=tree_positions(base, shape),
                                                 attn_mask=tree_attention_mask(shape))    # [B, T+1, V]
  p = shaped_probs(logits, sampling)
  keys, use = split_keys(state.keys)
  n_acc, path, nxt = accept_tree(p, dataclasses.replace(tree, n_nodes=n_nodes), shape, use, max_depth)
  n_acc = jnp.where(live, n_acc, 0)
  idx = jnp.arange(max_depth + 1)[None, :]
  src = jnp.where(idx <= n_acc[:, None], jnp.concatenate([jnp.zeros((b, 1), jnp.int32), path + 1], axis=1), 0)   # [B, D+1]
  cache = compact_path(after, base, src).with_lengths(base + jnp.where(live, 1 + n_acc, 0))
  on_path = jnp.take_along_axis(verified, src, axis=1)                             # [B, D+1] [last, path...]
  on_path = jnp.where((idx == 0) | (idx <= n_acc[:, None]), on_path, 0)
  emitted = jnp.where(idx == n_acc[:, None], nxt[:, None],
                      jnp.concatenate([on_path[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1))   # [B, D+1]
  gather = lambda h: jnp.take_along_axis(h, src[:, :, None], axis=1)              # [B, D+1, d_model]
  tapped = {"prenorm": gather(tapped["prenorm"]), "layers": tuple(gather(h) for h in tapped["layers"])}
  reach = jnp.max(jnp.where(shape.valid, shape.depth, 0), axis=1, initial=0)       # [B] deepest valid node
  state = dataclasses.replace(state, cache=cache, keys=keys)
  state, n_out = emit(state, emitted, jnp.where(live, n_acc + 1, 0), stop_ids, max_new)
  return state, n_acc, nxt, n_nodes, reach, on_path, tapped, live, n_out


def _round(params, dparams, cfg, drafter, sampling, dp, stop_ids, max_new, rollback, carry):
  state, dstate, stats = carry
  ctx = DraftContext(last=state.last, history=state.history, hist_len=state.hist_len,
                     target_len=state.cache.lengths, n_max=jnp.where(state.done, 0, dp["n_max"]), p_min=dp["p_min"],
                     temperature=sampling.temperature)
  draft, dstate = drafter.propose(dparams, dstate, ctx)
  if drafter.proposes_tree:   # static: tree drafters return a TreeDraft
    state, n_acc, nxt, n_nodes, reach, verified, tapped, live, n_out = verify_tree_and_accept(
        params, cfg, state, draft, dp, sampling, stop_ids, max_new, max_depth_of(drafter), taps=drafter.taps)
    stats = stats.update(reach, n_acc, live, n_out, n_verified=n_nodes)
  else:
    state, n_acc, nxt, dlen, verified, tapped, live, n_out = verify_and_accept(
        params, cfg, state, draft, dp, sampling, stop_ids, max_new, taps=drafter.taps, rollback=rollback)
    stats = stats.update(dlen, n_acc, live, n_out)
  result = RoundResult(n_accepted=n_acc, next_token=nxt, verified=verified, prenorm=tapped["prenorm"],
                       layer_taps=tapped["layers"], live=live)
  dstate = drafter.commit(dparams, dstate, result)
  return state, dstate, stats


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "capacity", "history_len"))
def _spec_prefill(params, dparams, tokens, prompt_lens, sampling, stop_ids, max_new, *,
                  cfg, drafter, capacity, history_len):
  state, tapped = prefill(params, cfg, tokens, prompt_lens, sampling, stop_ids, max_new, capacity,
                          history_len, taps=drafter.taps)
  dstate = drafter.init(dparams, tokens, prompt_lens, tapped, capacity)
  return state, dstate


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "rollback"), donate_argnames=("state", "dstate"))
def _spec_loop(params, dparams, state, dstate, sampling, dp, stop_ids, max_new, *, cfg, drafter, rollback="per_step"):
  """Every round of every sequence in one while_loop; shapes depend on capacity and history
  length only, so one compilation serves every prompt width."""
  width = max_depth_of(drafter) if drafter.proposes_tree else drafter.max_draft
  stats = RoundStats.zeros(state.last.shape[0], width)   # acceptance by position (trees: by depth)
  body = functools.partial(_round, params, dparams, cfg, drafter, sampling, dp, stop_ids, max_new, rollback)
  return jax.lax.while_loop(lambda c: ~jnp.all(c[0].done), body, (state, dstate, stats))


def _pad_to(x, width: int):
  """[B, w, ...] -> [B, width, ...] with zeros."""
  return jnp.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _adaptive_round(params, dparams, cfg, drafter, sampling, dp, stop_ids, max_new, rollback, width, carry):
  """One round at verification width `width` (static): every live sequence drafts up to `width`
  tokens (in the batched loop a shorter draft would save no verification work). No estimator runs
  on the device: the host reads acceptance by position from the round stats after each segment (a
  first version updated per-sequence estimates every round and ran 4-7% slower than the fixed loop
  at the same width on an H100)."""
  state, dstate, stats, i = carry
  k = drafter.max_draft
  ctx = DraftContext(last=state.last, history=state.history, hist_len=state.hist_len,
                     target_len=state.cache.lengths, n_max=jnp.where(state.done, 0, jnp.minimum(dp["n_max"], width)),
                     p_min=dp["p_min"], temperature=sampling.temperature)
  draft, dstate = drafter.propose(dparams, dstate, ctx)
  if width < k:
    draft = Draft(tokens=draft.tokens[:, :width], lengths=jnp.minimum(draft.lengths, width),
                  q=None if draft.q is None else draft.q[:, :width])
  state, n_acc, nxt, dlen, verified, tapped, live, n_out = verify_and_accept(
      params, cfg, state, draft, dp, sampling, stop_ids, max_new, taps=drafter.taps, rollback=rollback)
  stats = stats.update(dlen, n_acc, live, n_out)
  result = RoundResult(n_accepted=n_acc, next_token=nxt, verified=_pad_to(verified, k + 1),
                       prenorm=_pad_to(tapped["prenorm"], k + 1),
                       layer_taps=tuple(_pad_to(h, k + 1) for h in tapped["layers"]), live=live)
  dstate = drafter.commit(dparams, dstate, result)
  return state, dstate, stats, i + 1


def _plain_round(params, cfg, sampling, stop_ids, max_new, carry):
  """A width-0 round for drafters whose commit changes nothing (`commit_free`): the plain decoding
  step (`decode.decode_step_counted`), without drafting and without the verification / acceptance
  machinery, so backing off costs what plain decoding costs; lossless as plain decoding is."""
  state, dstate, stats, i = carry
  live = ~state.done
  state, n_out = decode_step_counted(params, cfg, state, sampling, stop_ids, max_new)
  zeros = jnp.zeros_like(n_out)
  return state, dstate, stats.update(zeros, zeros, live, n_out), i + 1


def _rounds_at(params, dparams, cfg, drafter, sampling, dp, stop_ids, max_new, rollback, width, rounds, carry):
  """Up to `rounds` (traced) rounds at one static verification width: a while_loop. Width 0 of a
  commit-free drafter is plain decoding steps."""
  if width == 0 and drafter.commit_free:
    body = functools.partial(_plain_round, params, cfg, sampling, stop_ids, max_new)
  else:
    body = functools.partial(_adaptive_round, params, dparams, cfg, drafter, sampling, dp, stop_ids, max_new,
                             rollback, width)
  state, dstate, stats = carry
  state, dstate, stats, ran = jax.lax.while_loop(
      lambda c: ~jnp.all(c[0].done) & (c[3] < rounds), body, (state, dstate, stats, jnp.int32(0)))
  return state, dstate, stats, ran


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Control:
  """What the device controller carries between segments."""
  replay: ReplayState      # replayed acceptance per width (replayable drafters)
  acceptance: adapt.AdaptiveState   # censored-geometric acceptance per sequence (other drafters)
  segment: jax.Array       # [] int32 segments run
  total: jax.Array         # [] int32 rounds run
  log_width: jax.Array     # [L] int32 width index of each segment (the last slot collects the rest)
  log_rounds: jax.Array    # [L] int32 rounds of each segment


ADAPTIVE_LOG = 512


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "rollback", "ac", "keep"),
                   donate_argnames=("state", "dstate"))
def _adaptive_run(params, dparams, state, dstate, sampling, dp, stop_ids, max_new, costs, force, max_rounds, *,
                  cfg, drafter, rollback, ac, keep=None):
  """Adaptive drafting in one jitted program: a while_loop over segments; before each, the
  controller picks the width that finishes the batch soonest (`adapt.choose_width_device`) from
  the round costs [W] (ms, measured in the warm-up) and per-sequence expected tokens per round, and
  runs up to `ac.segment_rounds` rounds at that width: the body holds one while_loop per width, and
  every one but the chosen runs zero rounds (a `lax.switch` over the widths ran rounds 21% slower
  than the fixed loop at batch 1 on an H100, same widths and rounds). No host round trip between
  segments (on an H100 each host-driven segment cost ~8.5 ms beyond its rounds, at batch 64 and 32
  alike). Expected tokens per round come from replaying the produced stream (`adaptive_replay`)
  for point-mass drafters that allow it (device ngram_simple: every width is evaluated on every
  segment, plain decoding included, so nothing needs exploring), otherwise from the censored-geometric
  acceptance per sequence, refreshed by a short segment at the widest width every
  `ac.explore_every` segments. `force` >= 0 pins the width index and runs one segment of
  `max_rounds` rounds (the warm-up's timing); `max_rounds` caps the rounds of the run. `keep`: the
  indices of `ac.widths_for(K)` left by `adapt.prune_widths` (costs [len(keep)]; width K alone runs
  `_spec_loop` instead)."""
  b, k = state.last.shape[0], drafter.max_draft
  widths = ac.widths_for(k)
  if keep is not None:
    widths = tuple(widths[i] for i in keep)
  replayable = drafter.replayable
  window = ac.segment_rounds * (k + 1) + k + 1
  ctl = _Control(replay=ReplayState.init(state.hist_len, len(widths)), acceptance=adapt.AdaptiveState.init(b, ac),
                 segment=jnp.int32(0), total=jnp.int32(0),
                 log_width=jnp.zeros((ADAPTIVE_LOG,), jnp.int32), log_rounds=jnp.zeros((ADAPTIVE_LOG,), jnp.int32))
  branches = [functools.partial(_rounds_at, params, dparams, cfg, drafter, sampling, dp, stop_ids, max_new, rollback, w)
              for w in widths]

  def body(carry):
    state, dstate, stats, ctl = carry
    live = ~state.done
    remaining = jnp.maximum(max_new - state.n_out, 1)
    if replayable:
      tau = adapt.tau_replayed(ctl.replay.tokens, ctl.replay.rounds, ac.prior_rounds)
      rounds = jnp.where(ctl.segment == 0, max(ac.segment_rounds // 2, 1), ac.segment_rounds).astype(jnp.int32)
      wi = adapt.choose_width_device(tau, live, remaining, costs, ac.tie)   # nothing replayed yet: the cheapest
    else:
      tau = adapt.tau_geometric(ctl.acceptance.alpha, widths)
      explore = ctl.segment % ac.explore_every == 0
      wi = jnp.where(explore, len(widths) - 1, adapt.choose_width_device(tau, live, remaining, costs, ac.tie))
      rounds = jnp.where(explore, ac.explore_rounds, ac.segment_rounds).astype(jnp.int32)
    wi = jnp.where(force >= 0, force, wi).astype(jnp.int32)
    rounds = jnp.minimum(jnp.where(force >= 0, max_rounds, rounds), max_rounds - ctl.total)
    before = stats
    carry, ran = (state, dstate, stats), jnp.int32(0)
    for i, run_rounds in enumerate(branches):   # one while_loop per width, all but the chosen one run 0 rounds
      *carry, n = run_rounds(jnp.where(wi == i, rounds, 0), tuple(carry))
      ran = ran + n
    state, dstate, stats = carry
    if replayable:
      replay = replay_segment(ctl.replay, drafter.propose_at, state.history, state.hist_len, widths, k, window, ac.decay)
      acceptance = ctl.acceptance
    else:
      replay = ctl.replay
      acceptance = adapt.update_totals(ctl.acceptance, stats.acc_tokens - before.acc_tokens,
                                       stats.rejected - before.rejected, ac.decay)
    slot = jnp.minimum(ctl.segment, ADAPTIVE_LOG - 1)
    ctl = _Control(replay=replay, acceptance=acceptance, segment=ctl.segment + 1, total=ctl.total + ran,
                   log_width=ctl.log_width.at[slot].set(wi), log_rounds=ctl.log_rounds.at[slot].add(ran))
    return state, dstate, stats, ctl

  stats = RoundStats.zeros(b, k)
  state, dstate, stats, ctl = jax.lax.while_loop(
      lambda c: ~jnp.all(c[0].done) & (c[3].total < max_rounds), body, (state, dstate, stats, ctl))
  r = ctl.replay
  replayed_tau = jnp.sum(r.tokens, 1) / jnp.maximum(jnp.sum(r.rounds, 1), 1e-6)     # [W] pooled, decayed
  return state, dstate, stats, (ctl.log_width, ctl.log_rounds, ctl.segment, ctl.total, replayed_tau)


def _measure_round_costs(params, dparams, state, dstate, sampling, dp, stop, *, cfg, drafter, rollback, ac,
                         timed=True) -> np.ndarray | None:
  """[len(widths)] ms per round at each width (drafting, the [B, w+1] verify forward, acceptance,
  commit, and the controller's per-segment work), timed with the adaptive program itself (width
  pinned by `force`) on copies of the live state with the budget lifted so no sequence stops
  early: one untimed call first (compiles), then three interleaved passes that time a short and a
  long run per width; the cost per round is the difference over the extra rounds (median per
  width), so the per-call cost (launch, the host's wait) drops out. None when the cache has no
  room for a few rounds (or `timed` is off: then it only compiles)."""
  copy = functools.partial(jax.tree_util.tree_map, jnp.copy)
  k, b = drafter.max_draft, state.last.shape[0]
  widths = ac.widths_for(k)
  room = min(int(state.cache.capacity) - int(jnp.max(state.cache.lengths)),
             int(state.history.shape[1]) - int(jnp.max(state.hist_len))) - 2 * (k + 1)
  long = min(32, max(room, 0) // (k + 1))
  short = min(8, long // 4)
  budget = jnp.full((b,), long * (k + 1) + 1, jnp.int32)
  costs0 = jnp.ones((len(widths),), jnp.float32)

  def run(i, rounds):
    a = (params, dparams, copy(state), copy(dstate), sampling, dp, stop, budget)
    jax.block_until_ready(a)
    t0 = time.perf_counter()
    out = _adaptive_run(*a, costs0, jnp.int32(i), jnp.int32(rounds), cfg=cfg, drafter=drafter, rollback=rollback, ac=ac)
    ran = int(out[3][3])     # waits for the run
    return (time.perf_counter() - t0) * 1e3, ran

  run(len(widths) - 1, min(long, 1) if timed else 0)   # compile (+ first launch)
  if short < 2 or not timed:
    return None
  ms = [[] for _ in widths]
  for _ in range(3):
    for i in range(len(widths)):
      (t_s, r_s), (t_l, r_l) = run(i, short), run(i, long)
      ms[i].append((t_l - t_s) / (r_l - r_s) if r_l > r_s else t_l / max(r_l, 1))
  return np.asarray([max(float(np.median(m)), 1e-3) for m in ms], np.float32)


def _adaptive_loop(params, dparams, state, dstate, sampling, dp, stop, max_new, *, cfg, drafter, rollback, ac, costs,
                   warm=False, cost_key=None):
  """Adaptive drafting on the device (`_adaptive_run`). Once per shape (`cost_key`) the round
  costs of every width are timed (`_measure_round_costs`) and replace the forward-only calibration;
  `warm` (a benchmark's untimed warm-up passes it) compiles the program, so a later timed run never
  compiles. Returns the state, the drafter state, the round stats and a record of the run (costs,
  widths, [width, rounds] per segment, replayed tokens per round by width)."""
  if drafter.proposes_tree:
    raise NotImplementedError("adaptive drafting picks chain lengths; tree drafters set their own budget")
  widths = ac.widths_for(drafter.max_draft)
  measure = ac.costs is None and cost_key is not None and cost_key not in adapt.TIMED
  if warm or measure:   # once per shape (a benchmark's untimed warm-up pays it), or to compile
    measured = _measure_round_costs(params, dparams, state, dstate, sampling, dp, stop, cfg=cfg, drafter=drafter,
                                    rollback=rollback, ac=ac, timed=measure)
    if measured is not None:
      costs = adapt.remember_costs(cost_key, measured)
  kept, kept_costs = adapt.prune_widths(widths, costs, ac.tie)
  record = {"widths": list(kept), "costs_ms": [float(c) for c in kept_costs], "widths_timed": list(widths),
            "measured_ms": (adapt._COSTS[cost_key].tolist() if cost_key in adapt.TIMED else None)}
  if kept == (drafter.max_draft,):   # nothing to choose: the fixed program itself
    state, dstate, stats = _spec_loop(params, dparams, state, dstate, sampling, dp, stop, max_new, cfg=cfg,
                                      drafter=drafter, rollback=rollback)
    return state, dstate, stats, {**record, "segments": [[int(kept[0]), int(jnp.max(stats.rounds))]],
                                  "n_segments": 1, "replayed_tau": None}
  keep = tuple(widths.index(w) for w in kept)
  state, dstate, stats, probe = _adaptive_run(params, dparams, state, dstate, sampling, dp, stop, max_new,
                                              jnp.asarray(kept_costs, jnp.float32), jnp.int32(-1), jnp.int32(2 ** 30),
                                              cfg=cfg, drafter=drafter, rollback=rollback, ac=ac, keep=keep)
  log_w, log_r, n_seg, _, tau = jax.device_get(probe)
  n = min(int(n_seg), ADAPTIVE_LOG)
  segments: list[list[int]] = []
  for wi, r in zip(log_w[:n], log_r[:n]):
    if r <= 0:
      continue
    if segments and segments[-1][0] == int(kept[wi]):
      segments[-1][1] += int(r)
    else:
      segments.append([int(kept[wi]), int(r)])
  return state, dstate, stats, {**record, "segments": segments, "n_segments": int(n_seg),
                                "replayed_tau": ([round(float(t), 4) for t in tau]
                                                 if drafter.replayable else None)}


@functools.partial(jax.jit, static_argnames=("cfg", "rollback"), donate_argnames=("state",))
def _host_round(params, state, stats, draft_tokens, draft_lengths, sampling, dp, stop_ids, max_new, *, cfg,
                rollback="per_step"):
  draft = Draft(tokens=draft_tokens, lengths=draft_lengths)
  hl_before = state.hist_len
  state, n_acc, _, dlen, _, _, live, n_out = verify_and_accept(params, cfg, state, draft, dp, sampling,
                                                               stop_ids, max_new, rollback=rollback)
  k1 = draft_tokens.shape[1] + 1
  cols = hl_before[:, None] + jnp.arange(k1)[None, :]
  new_tokens = jnp.take_along_axis(state.history, jnp.minimum(cols, state.history.shape[1] - 1), axis=1)
  return state, stats.update(dlen, n_acc, live, n_out), n_acc, dlen, new_tokens, n_out, state.done


@dataclasses.dataclass
class SpecResult:
  tokens: list[list[int]]
  stats: SpecStats
  seconds: float

  @property
  def n_generated(self) -> int:
    return sum(len(t) for t in self.tokens)

  @property
  def tokens_per_s(self) -> float:
    return self.n_generated / max(self.seconds, 1e-9)


def speculative_generate(params, cfg, prompts: list[list[int]], drafter, *, max_new_tokens: int = 128,
                         sampling: SamplingParams | None = None, draft_params: DraftParams | None = None,
                         stop_ids=(), capacity: int | None = None, warm_widths: bool = False,
                         rollback: str = "per_step", adaptive: "adapt.AdaptiveConfig | bool | None" = None) -> SpecResult:
  """Speculative generation of a ragged batch of token prompts with one drafter. `rollback`
  ("per_step" | "redecode") is how a hybrid target's recurrent state goes back after a rejection.
  `adaptive` (True or an `AdaptiveConfig`) turns on adaptive drafting (`specjax.engine.adaptive`)."""
  check_drafter(drafter)
  tokens, lens = pad_prompts(prompts)
  b, k = len(prompts), drafter.max_draft
  sampling = sampling or SamplingParams.make(b)
  dp = {n: jnp.asarray(a) for n, a in (draft_params or DraftParams(n_max=k)).arrays(b, k).items()}
  cap = plan_capacity(tokens.shape[1], max_new_tokens, k + 1, capacity)
  stop = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
  max_new = jnp.full((b,), max_new_tokens, jnp.int32)
  history_len = cap if capacity is not None else tokens.shape[1] + max_new_tokens + k + 2
  if adaptive is True:
    adaptive = adapt.AdaptiveConfig()
  costs, record = None, None
  if adaptive:   # measured once per shape (cached): a benchmark's warm-up pays for it
    costs = (np.asarray(adaptive.costs, np.float32) if adaptive.costs is not None else
             adapt.calibrate(params, cfg, b, cap, adaptive.widths_for(k), context=int(np.max(lens))))
    if len(costs) != len(adaptive.widths_for(k)):
      raise ValueError(f"adaptive.costs has {len(costs)} entries for widths {adaptive.widths_for(k)}")
  t0 = time.perf_counter()
  if drafter.on_device:
    dparams = drafter.params()
    state, dstate = _spec_prefill(params, dparams, jnp.asarray(tokens), jnp.asarray(lens), sampling, stop, max_new,
                                  cfg=cfg, drafter=drafter, capacity=cap, history_len=history_len)
    if adaptive:
      state, dstate, stats, record = _adaptive_loop(params, dparams, state, dstate, sampling, dp, stop, max_new,
                                                    cfg=cfg, drafter=drafter, rollback=rollback, ac=adaptive,
                                                    costs=costs, warm=warm_widths,
                                                    cost_key=adapt.cost_key(params, cfg, b, cap, adaptive.widths_for(k)))
    else:
      state, dstate, stats = _spec_loop(params, dparams, state, dstate, sampling, dp, stop, max_new, cfg=cfg,
                                        drafter=drafter, rollback=rollback)
    drafter.end_device(dstate)       # drafters with cross-request memory by design keep it (ngram_mod's table)
    jax.block_until_ready(state.hist_len)
    seconds, draft_seconds = time.perf_counter() - t0, 0.0
  else:
    state, stats, draft_seconds, record = _host_loop(params, cfg, drafter, prompts, tokens, lens, sampling, dp,
                                                     stop, max_new, cap, history_len, warm_widths, rollback,
                                                     adaptive or None, costs)
    seconds = time.perf_counter() - t0
  outs = outputs_of(state)
  return SpecResult(tokens=outs, seconds=seconds,
                    stats=SpecStats.from_rounds(drafter.name, stats, b, seconds, draft_seconds, adaptive=record))


def _host_loop(params, cfg, drafter, prompts, tokens, lens, sampling, dp, stop, max_new, cap, history_len,
               warm_widths=False, rollback="per_step", adaptive=None, costs=None):
  b, k = len(prompts), drafter.max_draft
  control = adapt.HostController(adaptive, b, k, costs) if adaptive else None
  state = prefill_jit(params, jnp.asarray(tokens), jnp.asarray(lens), sampling, stop, max_new,
                      cfg=cfg, capacity=cap, history_len=history_len)
  stats = RoundStats.zeros(b, k)
  if warm_widths:   # compile every verify width now (on a throwaway copy), so timed runs never compile
    width, widest = 1, min(k, 1 << int(max(int(np.asarray(dp["n_max"]).max()), 1) - 1).bit_length())
    while True:
      w = min(width, widest)
      _host_round(params, jax.tree_util.tree_map(jnp.copy, state), stats, jnp.zeros((b, w), jnp.int32),
                  jnp.zeros((b,), jnp.int32), sampling, dp, stop, max_new, cfg=cfg, rollback=rollback)
      if w >= widest:
        break
      width *= 2
  first = np.asarray(state.last)
  histories = [list(p) + [int(first[i])] for i, p in enumerate(prompts)]
  done = np.asarray(state.done)
  n_max = np.asarray(dp["n_max"])
  drafter.begin([list(p) for p in prompts])
  draft_seconds = 0.0
  while not done.all():
    t0 = time.perf_counter()
    asked = np.where(done, 0, n_max) if control is None else control.lengths(n_max, ~done)
    d_tok, d_len, _ = drafter.propose(histories, asked)
    draft_seconds += time.perf_counter() - t0
    d_len = np.minimum(np.asarray(d_len, np.int32), np.minimum(n_max, asked))
    # Verify only as wide as this round's longest draft (power-of-two widths: few compilations).
    width = min(k, 1 << int(max(int(d_len.max()), 1) - 1).bit_length())
    d_tok = np.asarray(d_tok, np.int32).reshape(b, -1)[:, :width]
    state, stats, n_acc, dlen, new_tokens, n_new, done_dev = _host_round(
        params, state, stats, jnp.asarray(d_tok), jnp.asarray(d_len), sampling, dp, stop, max_new, cfg=cfg,
        rollback=rollback)
    live = ~done
    n_acc, dlen, new_tokens, n_new, done = (np.asarray(x) for x in (n_acc, dlen, new_tokens, n_new, done_dev))
    if control is not None:
      control.observe(dlen, n_acc, live)
    t0 = time.perf_counter()
    drafter.accept(n_acc, verified=dlen > 0)   # a draft cut by n_min was not rejected, just not verified
    for i in range(b):
      histories[i].extend(new_tokens[i, : n_new[i]].tolist())
    draft_seconds += time.perf_counter() - t0
  drafter.end(histories)        # e.g. the suffix drafter's global tree learns the final tokens
  return state, stats, draft_seconds, None if control is None else control.record()
