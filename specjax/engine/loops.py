"""The jitted drivers around `run_round`: the one prefill, the fixed device loop (every round of
every sequence in one `lax.while_loop`, no host round trip per round), a bounded loop at one
width (the adaptive controller's segments) and a bounded loop of plain decoding steps (the host
loop's rounds where no sequence drafts)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax import parallel
from specjax.engine.generation import prefill
from specjax.engine.packed_tree import unpack
from specjax.engine.round import Carry, RoundInputs, RoundSpec, run_round
from specjax.engine.stats import RoundStats


@functools.partial(jax.jit, static_argnames=("spec", "capacity", "history_len"))
def prefill_request(spec: RoundSpec, inp: RoundInputs, tokens, prompt_lens, *, capacity: int,
                    history_len: int) -> Carry:
  """The prompts [B, T] (right-padded, lengths [B]) through the target, the first token sampled,
  and the device drafter's state built from the prompt pass (its tapped hidden states). Plain
  decoding and host drafters (`spec.drafter` None) carry no drafter state. Under a mesh the state is
  split over "data" by sequence and the KV cache over "model" by heads (no-op on one device)."""
  state, tapped = prefill(inp.params, spec.cfg, tokens, prompt_lens, inp.sampling, inp.stop_ids, inp.max_new,
                          capacity, history_len, taps=spec.taps)
  dstate = () if spec.drafter is None else spec.drafter.init(inp.dparams, tokens, prompt_lens, tapped, capacity)
  b = tokens.shape[0]
  dstate = parallel.constrain_state(dstate, b, kv_on_model=spec.drafter_kv_on_model)
  return Carry(state=parallel.constrain_state(state), dstate=dstate, stats=RoundStats.zeros(b, spec.stats_width))


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("carry",))
def device_loop(spec: RoundSpec, inp: RoundInputs, carry: Carry) -> Carry:
  """Rounds until every sequence is done. Shapes depend on capacity and history length only, so
  one compilation serves every prompt width."""
  return jax.lax.while_loop(lambda c: ~jnp.all(c.state.done), lambda c: run_round(spec, inp, c)[0], carry)


def rounds_at(spec: RoundSpec, inp: RoundInputs, rounds, carry: Carry) -> tuple[Carry, jax.Array]:
  """Up to `rounds` (traced) rounds at `spec.width` (static); -> (carry, rounds run)."""
  def body(c):
    carry, ran = c
    return run_round(spec, inp, carry)[0], ran + 1
  return jax.lax.while_loop(lambda c: ~jnp.all(c[0].state.done) & (c[1] < rounds), body, (carry, jnp.int32(0)))


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("carry",))
def plain_rounds(spec: RoundSpec, inp: RoundInputs, carry: Carry, rounds) -> tuple[Carry, jax.Array]:
  """Up to `rounds` (traced) plain decoding steps as rounds of a host drafter's loop (`spec.drafter`
  None; the host loop's `inp`, whose weights may be `PackedTree`s); -> (carry, rounds run)."""
  inp = dataclasses.replace(inp, params=unpack(inp.params), dparams=unpack(inp.dparams))
  return rounds_at(dataclasses.replace(spec, width=0), inp, rounds, carry)


@functools.partial(jax.jit, static_argnames=("spec", "window"), donate_argnames=("carry",))
def plain_segment(spec: RoundSpec, inp: RoundInputs, carry: Carry, rounds, *, window: int):
  """`plain_rounds` (`rounds` <= `window`, static) and what the host reads of it, computed into
  arrays of their own (none is a carry leaf), so they stay readable after the carry is donated to
  the next call: the host loop queues the next segment before it waits for this one.
  -> (carry, (tokens made [B, window] (the first n_made of each row), n_made [B], live [B] (not
  done), rounds run []))."""
  before = carry.state.hist_len
  carry, ran = plain_rounds(spec, inp, carry, rounds)
  history = carry.state.history
  cols = jnp.minimum(before[:, None] + jnp.arange(window)[None, :], history.shape[1] - 1)   # [B, window]
  made = jnp.take_along_axis(history, cols, axis=1)
  return carry, (made, carry.state.hist_len - before, ~carry.state.done, ran)
