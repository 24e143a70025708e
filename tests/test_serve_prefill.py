"""Batched joining in the server (`specjax.serve.joining`, `slot_programs.prefill_rows`): requests
that arrive together are prefilled in one program call, their prompts stacked as rows (one of
them long enough to take two chunks, its slot mid-prompt while the others run rounds), and every
request's tokens equal offline greedy generation of its prompt alone, for plain decoding (chunked
prefill) and for a drafter that reads the prompt pass's features (a random MTP head, one pass);
the prefill budget decides which requests a call takes."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import TINY_LLAMA, random_params
from specjax.drafters.base import DraftParams
from specjax.models.load import LoadedModel
from specjax.serve.cli import build_server
from specjax.serve.joining import make_joining, piece_width, piece_widths, plan, prefill_buckets
from specjax.serve.scheduler import GenRequest

TINY_PARAMS = random_params(TINY_LLAMA, seed=0)
LONG = [1 + (5 * i) % 15 for i in range(90)]       # 90 tokens: two chunks of 64
PROMPTS = [[3, 1, 4, 1, 5], LONG, [2, 7, 1, 8], [9, 9, 8, 2, 4, 4, 3], [6, 2, 8], [1, 2, 3, 4, 5, 6]]
MAX_NEW = [12, 20, 30, 7, 16, 25]


@pytest.fixture(scope="module")
def offline():
  """Offline plain greedy generation of each prompt alone."""
  from specjax.engine.decode import generate_plain
  return [generate_plain(TINY_PARAMS, TINY_LLAMA, [p], max_new_tokens=n).tokens[0] for p, n in zip(PROMPTS, MAX_NEW)]


def _counted_scheduler(speculator):
  """A 4-slot scheduler over TINY_LLAMA (chunk 64, no stop token) whose engine records the rows of
  every prefill call."""
  from specjax.drafters.mtp import init_heads
  extra = {"mtp": {"head": init_heads(TINY_LLAMA, 2, seed=1), "n_max": 2}, None: {}}[speculator]
  server = build_server(LoadedModel("tiny", TINY_LLAMA, TINY_PARAMS), speculator, slots=4, capacity=128, chunk=64,
                        rounds_per_call=4, **extra)
  sched, calls = server.scheduler, []
  prefill = sched.engine.prefill

  def counted(joining):
    calls.append([len(j.prompt) for j in joining])
    return prefill(joining)
  sched.engine.prefill = counted
  return sched, calls


@pytest.mark.parametrize("speculator", [None, "mtp"])
def test_requests_arriving_together_prefill_in_one_call(offline, speculator):
  """Four requests submitted together (one 90 tokens long) into 4 slots, two more later: the
  first four are prefilled by one call of the batched program (plain decoding: the long prompt's
  first chunk beside the three short prompts, its second chunk in a later call while the three
  run rounds over every slot, its own masked; MTP: the whole prompts in one pass); the last two,
  submitted together once two slots are free, share one call too. Every request's tokens equal
  offline greedy generation of its prompt alone."""
  sched, calls = _counted_scheduler(speculator)
  chunked = sched.engine.chunked
  assert chunked == (speculator is None)
  # per round of a 4-round call: room for the four first rows in one call, no more
  sched.prefill_budget = 64 if chunked else 128
  events = {i: [] for i in range(6)}
  for i in range(4):
    sched.submit(GenRequest(PROMPTS[i], max_tokens=MAX_NEW[i]), events[i].append)
  sched._iteration()
  assert calls == [[5, 90, 4, 7]]
  if chunked:
    assert sched.running() == 3 and len(sched._joining) == 1     # the long prompt is mid-prompt
  while sched.running() > 2 or sched._joining:      # two slots free: the last two arrive together
    sched._iteration()
  for i in (4, 5):
    sched.submit(GenRequest(PROMPTS[i], max_tokens=MAX_NEW[i]), events[i].append)
  while sched.running() or sched.queue_length() or sched._joining:
    sched._iteration()
  assert calls[1:] == ([[90]] if chunked else []) + [[3, 6]], calls
  for i, want in enumerate(offline):
    tokens = sum((e.get("tokens", []) for e in events[i]), [])
    assert tokens == want and events[i][-1]["finish_reason"] == "length", i
  assert not sched.engine.live.any()


def test_prefill_plan_follows_the_budget():
  """A call takes the joining requests in arrival order while rows bucket x widest piece stays
  within the budget; the first always (a piece past the budget still progresses), chunked pieces
  at most one chunk."""
  assert prefill_buckets(4) == (1, 2, 4) and prefill_buckets(6) == (1, 2, 4, 6) and prefill_buckets(1) == (1,)
  make = lambda n: make_joining([1] * n, slot=0, draft=DraftParams(n_max=0))
  js = [make(10), make(70), make(5), make(300)]
  buckets = (1, 2, 4)
  kw = dict(buckets=buckets, grain=64, cap=512)
  assert plan(js, 64, chunk=64, force=True, **kw) == (js[:1], 64)
  assert plan(js, 256, chunk=64, force=True, **kw) == (js, 256)           # 4 rows x one chunk
  assert plan(js, 256, chunk=None, force=True, **kw) == (js[:2], 256)     # one pass: 2 rows x 128
  assert plan(js, 512, chunk=None, force=True, **kw) == (js[:3], 512)     # 4 rows x 512 is too much
  assert plan(js[3:], 64, chunk=None, force=True, **kw) == (js[3:], 512)  # 300 tokens pad to 64 x 2^3
  assert plan(js[3:], 64, chunk=None, force=False, **kw) == ([], 0)
  js[1].offset = 64
  assert plan(js, 128, chunk=64, force=True, **kw) == (js[:2], 128)       # the rest of the 70: 6 tokens
  assert np.all([j.slot == 0 for j in js])


def test_piece_widths_are_the_widths_pieces_pad_to():
  """Pieces pad to multiples of 64 up to the chunk, then to the chunk doubled, never past the slot's
  capacity; `piece_widths` lists the widths pieces of 1..capacity tokens get (what warm-up compiles)."""
  assert [piece_width(n, 256, 1024) for n in (1, 64, 65, 256, 257, 512, 513, 1000)] == [64, 64, 128, 256, 512, 512, 1024, 1024]
  assert piece_width(600, 256, 700) == 700 and piece_width(150, 64, 200) == 200   # never wider than the slot
  assert piece_widths(256, 1024) == [64, 128, 192, 256, 512, 1024]
  assert piece_widths(64, 200) == [64, 128, 200] and piece_widths(256, 200) == [64, 128, 192, 200]


def test_no_compilation_after_warm_up(fresh_compiles):
  """After `warm()`, requests joining together (one-pass MTP prefill: whole prompts of 5-90 tokens,
  several rows per call) and the rounds that follow compile nothing: the server's
  specjax_compiles_total stays where warm-up left it (a compile mid-serving stalls every slot);
  and what startup built is frozen out of the cyclic collector (a collection mid-serving scans only
  what serving allocates)."""
  import gc

  import jax
  from specjax.serve.metrics import COMPILE_EVENT
  sched, calls = _counted_scheduler("mtp")
  seen = []
  jax.monitoring.register_event_duration_secs_listener(lambda name, s, **_: seen.append(s) if name == COMPILE_EVENT else None)
  sched.prefill_budget = 128           # per round of a 4-round call: the four first prompts in one call
  gc.unfreeze()
  sched.warm()
  assert gc.get_freeze_count() > 1000
  before, compiled = len(seen), sched.metrics.compiles._value.get()
  events = {i: [] for i in range(6)}
  for i in range(4):
    sched.submit(GenRequest(PROMPTS[i], max_tokens=MAX_NEW[i]), events[i].append)
  while sched.running() > 2 or sched._joining:
    sched._iteration()
  for i in (4, 5):
    sched.submit(GenRequest(PROMPTS[i], max_tokens=MAX_NEW[i]), events[i].append)
  while sched.running() or sched.queue_length() or sched._joining:
    sched._iteration()
  assert calls[0] == [5, 90, 4, 7] and all(events[i][-1]["finish_reason"] == "length" for i in events)
  assert len(seen) == before, f"{len(seen) - before} compilations after warm-up"
  assert sched.metrics.compiles._value.get() == compiled > 0
  assert "specjax_compiles_total" in sched.metrics.render().decode()


@pytest.mark.parametrize("speculator", ["mtp", "suffix", "dflash_tree_adaptive"])
def test_warm_up_compiles_every_program_ahead(monkeypatch, speculator, fresh_compiles):
  """`warm` compiles its prefill and round programs in worker threads first (`compile_ahead`,
  two at a time here); the calls that follow find them compiled: the only XLA compilation after
  `compile_ahead` is the program that frees slots. A device drafter with one-pass prefill (MTP),
  a host drafter (suffix: a verification program per draft width) and a tree drafter with adaptive
  node budgets (a round program per budget, each timed for the controller after compile_ahead)."""
  import jax
  from specjax.serve import engine_adapter
  from specjax.serve.metrics import COMPILE_EVENT
  from specjax.drafters.mtp import init_heads
  from specjax.drafters.registry import _example_dflash
  target = LoadedModel("tiny", TINY_LLAMA, TINY_PARAMS)
  extra = {"mtp": {"head": init_heads(TINY_LLAMA, 2, seed=1), "n_max": 2}, "suffix": {"n_max": 2},
           "dflash_tree_adaptive": {"head": _example_dflash(target, None)["head"], "n_max": 2, "adaptive": True,
                                    "options": {"depth": 3, "top_k": 2, "n_nodes": 8}}}[speculator]
  server = build_server(target, speculator.replace("_adaptive", ""), slots=4, capacity=128, chunk=64,
                        rounds_per_call=4, **extra)
  engine = server.scheduler.engine
  engine.compile_threads = 2
  jax.clear_caches()                   # programs other tests compiled count here too
  seen, ahead = [], {}
  jax.monitoring.register_event_duration_secs_listener(lambda name, s, **_: seen.append(s) if name == COMPILE_EVENT else None)
  compile_ahead = engine_adapter.compile_ahead

  def counted(lowerings, threads):
    before = len(seen)
    compile_ahead(lowerings, threads)
    ahead.update(programs=len(lowerings), compiled=len(seen) - before, end=len(seen))
  monkeypatch.setattr(engine_adapter, "compile_ahead", counted)
  server.scheduler.warm()
  rounds = len(engine._widths()) * len(engine.buckets)
  assert ahead["programs"] > rounds and ahead["compiled"] >= ahead["programs"]
  after = len(seen) - ahead["end"]      # the program that frees slots; adaptive: the one copying the batch to time rounds
  assert after <= (2 if engine.control is not None else 1), f"{after} compilations after compile_ahead"


def test_one_pass_prompt_near_a_capacity_off_the_64_grid():
  """A slot capacity that is no multiple of 64 (200) and a 150-token prompt prefilled in one pass
  (random-head MTP): the piece pads to the capacity, not past it, and the request's tokens equal
  offline greedy generation."""
  from specjax.drafters.mtp import init_heads
  from specjax.engine.decode import generate_plain
  server = build_server(LoadedModel("tiny", TINY_LLAMA, TINY_PARAMS), "mtp", slots=2, capacity=200, chunk=64,
                        rounds_per_call=4, head=init_heads(TINY_LLAMA, 2, seed=1), n_max=2)
  sched, prompt, events = server.scheduler, LONG + LONG[:60], []
  sched.submit(GenRequest(prompt, max_tokens=20), events.append)
  while sched.running() or sched.queue_length() or sched._joining:
    sched._iteration()
  assert sum((e.get("tokens", []) for e in events), []) == list(generate_plain(TINY_PARAMS, TINY_LLAMA, [prompt],
                                                                                   max_new_tokens=20).tokens[0])


def test_waiting_requests_run_calls_to_the_expected_end_of_a_request():
  """Twelve requests queued on 4 slots of a speculating server (a random MTP head, n_max 2: a round
  emits up to 3 tokens, in practice about 1): while requests wait, a call runs the rounds until the
  first running request is expected to end at its slot's tokens per round, not at the most a round
  can emit. Counted on the same queue with the old rule patched in: fewer device calls, no more
  prefill calls, and the same tokens for every request (scheduling changes no output)."""
  from specjax.serve import scheduler as sched_mod

  def serve(old_rule: bool):
    sched, _ = _counted_scheduler("mtp")
    if old_rule:
      sched._expected_rounds_left = lambda: -(-min(h.request.max_tokens - h.n_out for h in sched._slots
                                                    if h is not None) // sched.engine.max_tokens_per_round)
    events = {i: [] for i in range(12)}
    for i in range(12):
      sched.submit(GenRequest(PROMPTS[i % len(PROMPTS)][:8], max_tokens=24), events[i].append)
    while sched.running() or sched.queue_length() or sched._joining:
      sched._iteration()
    tokens = [[t for e in events[i] for t in e.get("tokens", [])] for i in range(12)]
    return tokens, sched.metrics.calls._value.get(), sched.metrics.prefill_calls._value.get()

  assert sched_mod.RATE_ROUNDS <= 24
  new_tokens, new_calls, new_prefills = serve(old_rule=False)
  old_tokens, old_calls, old_prefills = serve(old_rule=True)
  assert new_tokens == old_tokens and all(len(t) == 24 for t in new_tokens)
  assert new_calls < old_calls and new_prefills <= old_prefills, (new_calls, old_calls, new_prefills, old_prefills)
