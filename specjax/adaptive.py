"""Adaptive drafting: per-sequence draft lengths from running acceptance, and a batch-wide
verification width chosen by measured cost, backing off to plain decoding when speculation does
not pay.

Each sequence i keeps an exponentially decayed estimate of its drafter's per-token acceptance
alpha_i (censored-geometric maximum likelihood: accepted tokens / (accepted tokens + rejections))
and of its draft yield rho_i (how often the drafter had a draft at all when asked). With draft
length n its expected tokens per round are

    E_i(n) = 1 + rho_i * (alpha_i + alpha_i^2 + ... + alpha_i^n).

On the host loop a sequence drafts at most n_i* tokens, the longest draft whose last token is still
reached with probability alpha_i^n >= `reach_min` (its running acceptance sets its length: host
drafting costs time per token). On the device loop every sequence is verified at the batch's
width anyway, so drafts fill it (`device_reach_min` = 0: a shorter draft would save nothing); there
the sequences' running acceptances act through the width choice. The verification
width w is the same for the whole batch (verification is one [B, w+1] forward), taken from a few
compiled widths; w = 0 is a plain decode step. The device loop runs in segments of
`segment_rounds` rounds at one static width (a width per segment chosen on the host from the
running estimates). A first version chose per round with a `lax.switch` over widths and ran 24%
slower than fixed n_max 2 at batch 64 on an H200 with the same tau; the suspected cause (not
profiled) is XLA copying the carried KV cache through the conditional. The host loop chooses
every round. The controller picks

    w = argmax_w  sum_i E_i(min(w, n_i*)) / cost(B, w),

with cost(B, w) the measured milliseconds of a target forward of w + 1 tokens at this batch
size and capacity (`calibrate`, once per shape; it is cached). At large batches verification of
many tokens stops being free (the forward becomes compute-bound), cost grows with w and the
argmax moves to short drafts or to w = 0: speculation backs off by itself.

Off / on: `speculative_generate(..., adaptive=AdaptiveConfig())`, bench methods `adaptive: true`.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class AdaptiveConfig:
  decay: float = 0.8              # weight of the past in the running estimates (per round)
  reach_min: float = 0.2          # host loop: draft while the last token is reached with at least this
                                  # probability (host drafting costs time per token)
  device_reach_min: float = 0.0   # device loop: the same cap. 0: drafts fill the chosen width. In the
                                  # batched device loop every sequence is verified at the width w anyway,
                                  # so a shorter draft saves nothing and only loses the tokens that would
                                  # have been accepted; the width choice is what follows acceptance.
  prior_alpha: float = 0.5        # starting per-token acceptance (weight `prior_weight` rounds)
  prior_weight: float = 2.0
  widths: tuple[int, ...] | None = None   # verification widths to choose from (default 0, 1, 2, 4, .., K)
  costs: tuple[float, ...] | None = None  # ms per width, given instead of measured (`calibrate`)
  segment_rounds: int = 16        # device loop: rounds per segment; the width is chosen per segment
  explore_every: int = 4          # after this many segments (host loop: x segment_rounds rounds) of
                                  # plain decoding, one at the best non-zero width refreshes the estimates

  def widths_for(self, k: int) -> tuple[int, ...]:
    if self.widths is not None:
      ws = sorted({min(int(w), k) for w in self.widths} | {0})
    else:
      ws, w = {0, k}, 1
      while w < k:
        ws.add(w)
        w *= 2
      ws = sorted(ws)
    return tuple(ws)


def _xp(x):
  """numpy for host arrays (the host loop), jax.numpy for device arrays and tracers (the device loop):
  the estimator below is written once for both."""
  return np if isinstance(x, (np.ndarray, np.generic)) else jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptiveState:
  accepted: jax.Array   # [B] f32 decayed accepted draft tokens
  trials: jax.Array     # [B] f32 decayed accepted tokens + rejections
  yield_: jax.Array     # [B] f32 decayed fraction of asked rounds with a non-empty draft

  @staticmethod
  def init(batch: int, ac: AdaptiveConfig, xp=jnp) -> "AdaptiveState":
    full = lambda v: xp.full((batch,), v, xp.float32)
    return AdaptiveState(accepted=full(ac.prior_alpha * ac.prior_weight), trials=full(ac.prior_weight),
                         yield_=full(1.0))

  @property
  def alpha(self) -> jax.Array:
    xp = _xp(self.accepted)
    return xp.clip(self.accepted / xp.maximum(self.trials, 1e-6), 0.0, 0.999)


def longest_useful(alpha, n_max, reach_min: float):
  """[B] the longest n <= n_max with alpha^n >= reach_min (0 when even one token is not worth it)."""
  xp = _xp(alpha)
  if reach_min <= 0:                   # no cap: every sequence drafts up to n_max
    return xp.broadcast_to(xp.asarray(n_max), alpha.shape).astype(xp.int32)
  logs = xp.minimum(xp.log(xp.maximum(alpha, 1e-6)), -1e-6)
  return xp.clip(xp.floor(np.log(reach_min) / logs), 0, n_max).astype(xp.int32)


def expected_tokens(alpha, rho, n):
  """[B] 1 + rho * sum_{j=1..n} alpha^j."""
  xp = _xp(alpha)
  return 1.0 + rho * alpha * (1.0 - alpha ** n) / xp.maximum(1.0 - alpha, 1e-6)


def choose_width_np(alpha, yield_, n_max, live, widths: tuple[int, ...], costs, reach_min: float,
                    explore: bool = False) -> int:
  """Index into widths maximizing expected tokens per ms (with `explore`, the best non-zero width:
  estimates only move when drafts are verified, so backing off for good would freeze them)."""
  alpha, yield_ = np.asarray(alpha, np.float64), np.asarray(yield_, np.float64)
  n_w = np.minimum(np.asarray(widths)[:, None], longest_useful(alpha, np.asarray(n_max), reach_min)[None, :])
  gain = np.sum(np.where(np.asarray(live)[None, :], expected_tokens(alpha, yield_, n_w), 0.0), axis=1)
  rate = gain / np.asarray(costs, np.float64)
  if explore and len(widths) > 1:
    rate = np.where(np.asarray(widths) > 0, rate, -np.inf)
  return int(np.argmax(rate))


def update(ast: AdaptiveState, asked, dlen, n_acc, live, decay: float) -> AdaptiveState:
  """After a round: asked [B] requested draft lengths, dlen [B] verified lengths, n_acc [B]."""
  xp = _xp(ast.accepted)
  drafted = live & (dlen > 0)
  asked_ = live & (asked > 0)
  acc = xp.where(drafted, decay * ast.accepted + n_acc, ast.accepted)
  trials = xp.where(drafted, decay * ast.trials + n_acc + (n_acc < dlen), ast.trials)
  yld = xp.where(asked_, decay * ast.yield_ + (1 - decay) * drafted, ast.yield_)
  return AdaptiveState(accepted=acc.astype(xp.float32), trials=trials.astype(xp.float32),
                       yield_=yld.astype(xp.float32))


# ----------------------------------------------------------------------------------------------
# the cost of a verification width, measured


_COSTS: dict = {}


def cost_key(params, cfg, batch: int, capacity: int, widths: tuple[int, ...]) -> tuple:
  dtype = jax.tree_util.tree_leaves(params)[0].dtype
  return (cfg, batch, capacity, widths, str(dtype), jax.default_backend())


_MEASURED: set = set()    # shapes whose cached costs are timed whole rounds, not the forward-only calibration


def remember_costs(key: tuple, costs) -> np.ndarray:
  """Replace the cached costs of a shape by better ones (the device loop times whole rounds once
  per shape: `engine._measure_round_costs`)."""
  out = np.maximum.accumulate(np.maximum(np.asarray(costs, np.float32), 1e-3))
  _COSTS[key] = out
  _MEASURED.add(key)
  return out


def calibrate(params, cfg, batch: int, capacity: int, widths: tuple[int, ...], *, context: int = 0,
              repeats: int = 5) -> np.ndarray:
  """[len(widths)] median ms of one target forward of w + 1 tokens per sequence at this batch and
  cache capacity (cache filled to `context`). Cached per shape, so a benchmark's warm-up pays it.
  A first estimate: it leaves out the sampling / acceptance over [B, w+1, V] and the drafting, and
  on an H200 at batch 64 it grew too little with w (the controller chose wide widths that cost as
  much as fixed n_max 8); the device loop's warm-up replaces it by timed whole rounds."""
  from specjax.generation import target_of
  key = cost_key(params, cfg, batch, capacity, widths)
  dtype = jax.tree_util.tree_leaves(params)[0].dtype
  if key in _COSTS:
    return _COSTS[key]
  target = target_of(cfg)
  ctx = min(context or capacity // 2, capacity - max(widths) - 1)
  state = target.init_state(cfg, batch, capacity, dtype)
  state = jax.tree_util.tree_map(lambda x: x, state)
  if hasattr(state, "with_lengths"):
    state = state.with_lengths(jnp.full((batch,), ctx, jnp.int32))
  costs = []
  for w in widths:
    fwd = jax.jit(functools.partial(_forward_logits, target=target, cfg=cfg))
    toks = jnp.zeros((batch, w + 1), jnp.int32)
    jax.block_until_ready(fwd(params, toks, state))
    ts = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(fwd(params, toks, state))
      ts.append(time.perf_counter() - t0)
    costs.append(float(np.median(ts)) * 1e3)
  out = np.maximum(np.asarray(costs, np.float32), 1e-3)
  out = np.maximum.accumulate(out)      # a wider forward never costs less (timer noise aside)
  _COSTS[key] = out
  return out


def _forward_logits(params, tokens, state, *, target, cfg):
  logits, _, _ = target.forward(params, cfg, tokens, state)
  return jnp.argmax(logits, axis=-1)     # what verification reads; keeps the LM head live


class HostController:
  """The same controller for the host loop (numpy, no device round trip): `lengths` before a
  round, `observe` after it."""

  def __init__(self, ac: AdaptiveConfig, batch: int, k: int, costs: np.ndarray):
    self.ac, self.widths, self.costs = ac, ac.widths_for(k), np.asarray(costs, np.float64)
    self.state = AdaptiveState.init(batch, ac, np)
    self.asked = np.zeros(batch, np.int64)
    self.plain_rounds = 0

  def lengths(self, n_max: np.ndarray, live: np.ndarray) -> np.ndarray:
    explore = self.plain_rounds >= self.ac.explore_every * self.ac.segment_rounds
    w = self.widths[choose_width_np(self.state.alpha, self.state.yield_, n_max, live, self.widths, self.costs,
                                    self.ac.reach_min, explore)]
    self.plain_rounds = self.plain_rounds + 1 if w == 0 else 0
    self.asked = np.where(live, np.minimum(w, longest_useful(self.state.alpha, n_max, self.ac.reach_min)), 0)
    return self.asked

  def observe(self, dlen: np.ndarray, n_acc: np.ndarray, live: np.ndarray) -> None:
    self.state = update(self.state, self.asked, dlen, n_acc, live, self.ac.decay)
