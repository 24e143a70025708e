"""Plain autoregressive decoding: prefill, then the whole decode in one jitted `lax.while_loop`.

This is both a user-facing generator and the baseline every speculative method is measured
against (same prefill, same sampler, same emission rules).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import parallel
from specjax.engine.generation import GenState, emit, outputs_of, pad_prompts, plan_capacity, target_of
from specjax.engine.sampling import SamplingParams, next_token, split_keys


def decode_step_tapped(params, cfg, state: GenState, sampling: SamplingParams, stop_ids, max_new,
                       taps=()) -> tuple[GenState, jax.Array, dict]:
  """One token per live sequence: forward `last`, sample, emit. -> (state, emitted [B], the target's
  hidden states at `last`: {"prenorm": [B, 1, d], "layers": per tapped layer [B, 1, d]})."""
  live = (~state.done).astype(jnp.int32)
  logits, tapped, cache = target_of(cfg).forward(params, cfg, state.last[:, None], state.cache, n_new=live,
                                                 taps=taps)
  keys, use = split_keys(state.keys)
  token = next_token(logits[:, 0], sampling, use)                                # [B]
  state = dataclasses.replace(state, cache=cache, keys=keys)
  return (*emit(state, token[:, None], live, stop_ids, max_new), tapped)


def decode_step_counted(params, cfg, state: GenState, sampling: SamplingParams, stop_ids,
                        max_new) -> tuple[GenState, jax.Array]:
  """One token per live sequence: forward `last`, sample, emit. -> (state, emitted [B])."""
  return decode_step_tapped(params, cfg, state, sampling, stop_ids, max_new)[:2]


def decode_step(params, cfg, state: GenState, sampling: SamplingParams, stop_ids, max_new) -> GenState:
  """One token per live sequence (`decode_step_counted` without the count)."""
  return decode_step_counted(params, cfg, state, sampling, stop_ids, max_new)[0]


@functools.partial(jax.jit, static_argnames=("cfg", "unroll"), donate_argnames=("state",))
def _decode_loop(params, state, sampling, stop_ids, max_new, *, cfg, unroll=1):
  """The whole decode in one while_loop. Its shapes depend on the cache capacity and history
  length only, not on the prompt width: one compilation serves every prompt. `unroll` decode
  steps run per iteration (the loop condition is read back by the host once per iteration;
  finished sequences emit nothing in the extra steps)."""
  def body(s):
    s = parallel.constrain_state(s)     # under a mesh: batch on "data", KV heads on "model"
    for _ in range(unroll):
      s = decode_step(params, cfg, s, sampling, stop_ids, max_new)
    return s
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)


@dataclasses.dataclass
class DecodeResult:
  tokens: list[list[int]]     # generated tokens per sequence (stop token included when hit)
  seconds: float              # wall time of the jitted call (prefill + decode), after compile
  n_generated: int
  prefill_seconds: float | None = None   # with `split_prefill`: the prefill's share of `seconds`

  @property
  def tokens_per_s(self) -> float:
    return self.n_generated / max(self.seconds, 1e-9)


def _plain_inputs(params, cfg, prompts, max_new_tokens, sampling, stop_ids, capacity, max_new):
  """A plain generation's inputs, built on the host: -> (RoundInputs of its decode, a function that
  runs its prefill and returns the state the decode loop starts from)."""
  tokens, lens = pad_prompts(prompts)
  b = len(prompts)
  sampling = sampling or SamplingParams.make(b)
  cap = plan_capacity(tokens.shape[1], max_new_tokens, 0, capacity)
  max_new_arr = jnp.asarray(np.broadcast_to(max_new if max_new is not None else max_new_tokens, (b,)), jnp.int32)
  stop = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
  history_len = cap if capacity is not None else tokens.shape[1] + max_new_tokens + 1
  from specjax.engine.loops import prefill_request     # the engine's one prefill (imports this module)
  from specjax.engine.round import RoundInputs, RoundSpec
  inp = RoundInputs(params=params, dparams=(), sampling=sampling, dp={}, stop_ids=stop, max_new=max_new_arr)
  prefill = lambda: prefill_request(RoundSpec(cfg=cfg), inp, jnp.asarray(tokens), jnp.asarray(lens), capacity=cap,
                                    history_len=history_len).state
  return inp, prefill


def generate_plain(params, cfg, prompts: list[list[int]], *, max_new_tokens: int = 128,
                   sampling: SamplingParams | None = None, stop_ids=(), capacity: int | None = None,
                   max_new=None, unroll: int = 1, split_prefill: bool = False) -> DecodeResult:
  """Autoregressive generation for a ragged batch of token prompts. `split_prefill`: wait for the
  prefill and report its share of the time (`prefill_seconds`)."""
  inp, prefill = _plain_inputs(params, cfg, prompts, max_new_tokens, sampling, stop_ids, capacity, max_new)
  t0 = time.perf_counter()
  state = prefill()
  t_prefill = None
  if split_prefill:
    jax.block_until_ready(state)
    t_prefill = time.perf_counter() - t0
  state = _decode_loop(params, state, inp.sampling, inp.stop_ids, inp.max_new, cfg=cfg, unroll=unroll)
  jax.block_until_ready(state.hist_len)
  dt = time.perf_counter() - t0
  outs = outputs_of(state)
  return DecodeResult(tokens=outs, seconds=dt, n_generated=sum(len(o) for o in outs), prefill_seconds=t_prefill)


def decode_loop_hlo(params, cfg, prompts: list[list[int]], *, max_new_tokens: int = 128,
                    capacity: int | None = None, unroll: int = 1) -> str:
  """The compiled HLO text of the decode loop `generate_plain` runs for these prompts (the same
  program, lowered from the same inputs): for profiles that name its kernels."""
  inp, prefill = _plain_inputs(params, cfg, prompts, max_new_tokens, None, (), capacity, None)
  return _decode_loop.lower(params, prefill(), inp.sampling, inp.stop_ids, inp.max_new, cfg=cfg,
                            unroll=unroll).compile().as_text()
