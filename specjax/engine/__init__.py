"""The speculative engine: draft -> verify -> accept, for a batch of sequences, lossless.

One round function (`round.run_round`) and three drivers around it: the fixed device loop
(`loops.device_loop`: every round inside one jitted `lax.while_loop`), the adaptive segment loop
(`adaptive_loop`) and the host loop for host drafters (`host_loop`). `speculative_generate` is the
entry point: it builds the round's static spec and dynamic inputs, runs the one prefill and the
driver the drafter's declared capabilities call for.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import DraftParams, check_drafter
from specjax.engine import adaptive as adapt
from specjax.engine.adaptive_loop import adaptive_loop, timing_key
from specjax.engine.generation import outputs_of, pad_prompts, plan_capacity
from specjax.engine.host_loop import host_loop
from specjax.engine.loops import device_loop, prefill_request
from specjax.engine.round import Carry, RoundInputs, RoundSpec, Verdict, run_round, verify_chain, verify_tree
from specjax.engine.sampling import SamplingParams
from specjax.engine.stats import SpecStats

__all__ = ["Carry", "RoundInputs", "RoundSpec", "SpecResult", "Verdict", "run_round", "speculative_generate",
           "verify_chain", "verify_tree"]


@dataclasses.dataclass
class SpecResult:
  tokens: list[list[int]]
  stats: SpecStats
  seconds: float
  prefill_seconds: float | None = None    # with `split_prefill`: the prefill's share of `seconds`

  @property
  def n_generated(self) -> int:
    return sum(len(t) for t in self.tokens)

  @property
  def tokens_per_s(self) -> float:
    return self.n_generated / max(self.seconds, 1e-9)


def _adaptive_costs(adaptive, params, cfg, b, cap, k, lens, tree):
  """Round cost per width (ms): the config's, else the forward-only calibration (cached per shape)."""
  widths = adaptive.widths_for(k, tree=tree)
  costs = (np.asarray(adaptive.costs, np.float32) if adaptive.costs is not None else
           adapt.calibrate(params, cfg, b, cap, widths, context=int(np.max(lens))))
  if len(costs) != len(widths):
    raise ValueError(f"adaptive.costs has {len(costs)} entries for widths {widths}")
  return costs


def _device_run(spec, inp, tokens, lens, *, cap, history_len, adaptive, costs, warm_widths, marks=None):
  """Prefill and rounds of a device drafter. -> (carry, adaptive record or None). `marks`: a dict
  that gets the time the prefill ended ("prefill", waited for)."""
  carry = prefill_request(spec.prefill_spec(), inp, jnp.asarray(tokens), jnp.asarray(lens), capacity=cap,
                          history_len=history_len)
  if marks is not None:
    jax.block_until_ready(carry)
    marks["prefill"] = time.perf_counter()
  if not adaptive:
    return device_loop(spec, inp, carry), None
  b = tokens.shape[0]
  key = timing_key(spec, inp.params, b, cap, adaptive)
  return adaptive_loop(spec, inp, carry, ac=adaptive, costs=costs, warm=warm_widths, cost_key=key)


def speculative_generate(params, cfg, prompts: list[list[int]], drafter, *, max_new_tokens: int = 128,
                         sampling: SamplingParams | None = None, draft_params: DraftParams | None = None,
                         stop_ids=(), capacity: int | None = None, warm_widths: bool = False,
                         rollback: str = "per_step", adaptive: "adapt.AdaptiveConfig | bool | None" = None,
                         split_prefill: bool = False) -> SpecResult:
  """Speculative generation of a ragged batch of token prompts with one drafter. `rollback`
  ("per_step" | "redecode") is how a hybrid target's recurrent state goes back after a rejection.
  `adaptive` (True or an `AdaptiveConfig`) turns on adaptive drafting (`specjax.engine.adaptive`).
  `split_prefill`: wait for the prefill and report its share of the time (`prefill_seconds`; the
  wait costs the overlap of the prefill with what the host does next)."""
  check_drafter(drafter)
  tokens, lens = pad_prompts(prompts)
  b, k = len(prompts), drafter.max_draft
  sampling = sampling or SamplingParams.make(b)
  limit = None if drafter.proposes_tree else k       # a tree's n_max caps its depth: no bound needed
  dp = {n: jnp.asarray(a) for n, a in (draft_params or DraftParams(n_max=k)).arrays(b, limit).items()}
  cap = plan_capacity(tokens.shape[1], max_new_tokens, k + 1, capacity)
  history_len = cap if capacity is not None else tokens.shape[1] + max_new_tokens + k + 2
  adaptive = adapt.AdaptiveConfig() if adaptive is True else adaptive
  costs = _adaptive_costs(adaptive, params, cfg, b, cap, k, lens, drafter.proposes_tree) if adaptive else None
  inp = RoundInputs(params=params, dparams=drafter.params() if drafter.on_device else (), sampling=sampling, dp=dp,
                    stop_ids=jnp.asarray(list(stop_ids) or [-1], jnp.int32),
                    max_new=jnp.full((b,), max_new_tokens, jnp.int32))
  marks = {} if split_prefill else None
  t0 = time.perf_counter()
  if drafter.on_device:
    spec = RoundSpec(cfg=cfg, drafter=drafter, rollback=rollback)
    carry, record = _device_run(spec, inp, tokens, lens, cap=cap, history_len=history_len, adaptive=adaptive,
                                costs=costs, warm_widths=warm_widths, marks=marks)
    drafter.end_device(carry.dstate)   # drafters with cross-request memory by design keep it (ngram_mod's table)
    jax.block_until_ready(carry.state.hist_len)
    draft_seconds = 0.0
  else:
    spec = RoundSpec(cfg=cfg, rollback=rollback)
    carry, draft_seconds, record = host_loop(spec, inp, drafter, prompts, tokens, lens, capacity=cap,
                                             history_len=history_len, warm_widths=warm_widths,
                                             adaptive=adaptive or None, costs=costs, marks=marks)
  seconds = time.perf_counter() - t0
  return SpecResult(tokens=outputs_of(carry.state), seconds=seconds,
                    prefill_seconds=marks["prefill"] - t0 if marks else None,
                    stats=SpecStats.from_rounds(drafter.name, carry.stats, b, seconds, draft_seconds, adaptive=record))
