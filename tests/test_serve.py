"""The server: continuous batching is lossless per request (streamed greedy tokens through the
official `openai` client equal offline greedy generation of each prompt alone: the real SmolLM2
with two clients, and tiny random models with six requests over live slots gathered into batch
buckets, several rounds per device call, stop tokens and max_tokens reached inside a call's rounds,
plain / device / host drafters, several arrival orders), per-request speculative fields change
only that request's drafting, a bounded load test (valid, cancelled and malformed requests)
leaves the server healthy with every slot free, a full queue answers 429, the metrics count every
round's tokens and finish reasons, a cancel takes effect within one call, and the rounds per call
follow the waiting requests. Adaptive drafting: test_serve_adaptive.py; requests joining together
prefilled in one call: test_serve_prefill.py; bench-serve: test_bench_serve.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading

import httpx
import pytest

from conftest import TINY_LLAMA, random_params
from specjax.models.load import LoadedModel
from specjax.serve.app import run_in_thread
from specjax.serve.cli import build_server
from specjax.serve.scheduler import GenRequest, Scheduler

TINY_PARAMS = random_params(TINY_LLAMA, seed=0)

PROMPTS = ["List the days of the week, then list them again.", "Count from one to twelve in words."]
MAX_NEW = 24


@pytest.fixture(scope="module")
def real_server(smollm2_jax):
  """SmolLM2 behind the server: ngram_simple (size_n 2, drafts up to 4), 4 slots."""
  server = build_server(smollm2_jax, "ngram_simple", slots=4, capacity=256, n_max=4, chunk=64,
                        options={"size_n": 2})
  http, url = run_in_thread(server.app())
  yield server, url
  http.should_exit = True


@pytest.fixture(scope="module")
def offline(smollm2_jax):
  """Offline plain greedy generation of each prompt alone (`api.generate`)."""
  from specjax import api
  return [api.generate(smollm2_jax, [p], max_new_tokens=MAX_NEW).tokens[0] for p in PROMPTS]


def _stream(url: str, prompt: str, **extra) -> tuple[list[int], str, dict]:
  """One streamed chat completion through the openai client -> (token ids, text, usage)."""
  import openai
  client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
  ids, text, usage = [], [], None
  stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=MAX_NEW, temperature=0.0, stream=True,
                                          stream_options={"include_usage": True}, **extra)
  for chunk in stream:
    if chunk.usage is not None:
      usage = chunk.usage.model_extra["speculative"]
    for c in chunk.choices:
      ids += (c.model_extra or {}).get("token_ids") or []
      text.append(c.delta.content or "")
  return ids, "".join(text), usage


@pytest.mark.real
def test_concurrent_streams_equal_offline_greedy(real_server, offline, smollm2_jax):
  _, url = real_server
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(lambda p: _stream(url, p), PROMPTS))
  for (ids, text, usage), want in zip(results, offline):
    assert ids == want
    assert text == smollm2_jax.tokenizer.decode(want)
    assert usage["enabled"] and usage["rounds"] >= 1


@pytest.mark.real
def test_speculative_fields_change_only_their_request(real_server, offline):
  _, url = real_server
  off = {"extra_body": {"speculative": {"enabled": False}}}
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    spec_on = pool.submit(_stream, url, PROMPTS[0])
    spec_off = pool.submit(_stream, url, PROMPTS[1], **off)
    (ids_on, _, u_on), (ids_off, _, u_off) = spec_on.result(), spec_off.result()
  assert ids_on == offline[0] and ids_off == offline[1]      # both still lossless
  assert u_off["draft_tokens"] == 0 and not u_off["enabled"]
  assert u_off["rounds"] == len(ids_off) - 1                 # one token per round, after the prefill's
  assert u_on["draft_tokens"] > 0 and u_on["rounds"] < len(ids_on) - 1   # the other one kept drafting
  narrow = _stream(url, PROMPTS[0], extra_body={"speculative": {"n_max": 1}})[2]
  assert 0 < narrow["draft_tokens"] <= narrow["rounds"] and len(narrow["acceptance_by_position"]) == 4


@pytest.fixture(scope="module")
def tiny_server():
  target = LoadedModel("tiny", TINY_LLAMA, TINY_PARAMS)
  server = build_server(target, "ngram_simple", slots=8, capacity=128, n_max=4, max_queue=512,
                        options={"size_n": 2})
  http, url = run_in_thread(server.app())
  yield server, url
  http.should_exit = True


MALFORMED = [b"{not json", json.dumps({"prompt": []}), json.dumps({"prompt": [1, 2], "temperature": -1}),
             json.dumps({"prompt": [1, 99]}), json.dumps({"prompt": [1], "speculative": {"n_max": 99}}),
             json.dumps({"prompt": [1], "max_tokens": 0}), json.dumps([1, 2]),
             json.dumps({"prompt": [1], "speculative": {"bogus": 1}})]


async def _one(client: httpx.AsyncClient, i: int) -> tuple[str, int, int]:
  """Request i of the load test: malformed, cancelled mid-stream, streamed or whole."""
  if i % 10 == 3:
    r = await client.post("/v1/completions", content=MALFORMED[i // 10 % len(MALFORMED)])
    return "malformed", r.status_code, len(r.json()["error"]["message"])
  body = {"prompt": [1 + i % 13, 2, 3 + i % 5], "max_tokens": 3 + i % 4, "temperature": 0.0 if i % 2 else 0.7,
          "seed": i, "stream": i % 10 in (1, 5, 7)}
  if i % 10 == 7:   # cancelled: leave after the first chunk
    async with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 60}) as r:
      async for _ in r.aiter_lines():
        break
    return "cancelled", r.status_code, 0
  if body["stream"]:
    n = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
      async for line in r.aiter_lines():
        if line.startswith("data: {"):
          n += len(json.loads(line[6:])["choices"][0]["token_ids"])
    return "valid", r.status_code, n - body["max_tokens"]
  r = await client.post("/v1/completions", json=body)
  return "valid", r.status_code, r.json()["usage"]["completion_tokens"] - body["max_tokens"]


async def _load(url: str, n: int, concurrency: int):
  limit = asyncio.Semaphore(concurrency)
  async with httpx.AsyncClient(base_url=url, timeout=120) as client:
    async def guarded(i):
      async with limit:
        return await _one(client, i)
    return await asyncio.gather(*(guarded(i) for i in range(n)))


def test_load_cancel_malformed_then_healthy(tiny_server):
  server, url = tiny_server
  results = asyncio.run(_load(url, 200, 24))
  kinds = {k: [r for r in results if r[0] == k] for k in ("valid", "cancelled", "malformed")}
  assert all(code == 200 and short == 0 for _, code, short in kinds["valid"]), kinds["valid"]
  assert all(code == 400 and msg > 10 for _, code, msg in kinds["malformed"])
  assert len(kinds["valid"]) == 160 and len(kinds["cancelled"]) == 20 and len(kinds["malformed"]) == 20
  _wait(lambda: server.scheduler.running() == 0)          # cancelled and disconnected requests freed their slots
  health = httpx.get(f"{url}/health").json()
  assert health["status"] == "ok" and health["waiting"] == 0 and not server.scheduler.engine.live.any()
  metrics = httpx.get(f"{url}/metrics").text
  for name in ("specjax_tokens_per_second", "specjax_tau", "specjax_acceptance_by_position",
               "specjax_queue_length", "specjax_running_slots"):
    assert name in metrics
  assert 'specjax_requests_total{reason="cancelled"}' in metrics


async def _completions(url: str, bodies: list[dict]) -> list[httpx.Response]:
  """The bodies posted to /v1/completions at once."""
  async with httpx.AsyncClient(base_url=url, timeout=120) as client:
    return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))


def test_full_queue_answers_429_over_http():
  """One slot and room for two waiting requests: of 16 sent at once, those past the queue get 429
  with an OpenAI-style error body, every other one is answered in full, and the server stays
  healthy (and counts the refusals)."""
  target = LoadedModel("tiny", TINY_LLAMA, TINY_PARAMS)
  server = build_server(target, None, slots=1, capacity=128, max_queue=2)
  http, url = run_in_thread(server.app())
  try:
    bodies = [{"prompt": [1 + i % 13, 2, 3], "max_tokens": 40} for i in range(16)]
    answers = asyncio.run(_completions(url, bodies))
    codes = [r.status_code for r in answers]
    assert set(codes) == {200, 429} and codes.count(429) >= 10, codes
    for r in answers:
      if r.status_code == 429:
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == 429 and "limit 2" in err["message"]
      else:
        assert r.json()["usage"]["completion_tokens"] == 40
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["waiting"] == 0 and health["running"] == 0
    assert f'specjax_rejected_requests_total{{code="429"}} {codes.count(429)}.0' in httpx.get(f"{url}/metrics").text
  finally:
    http.should_exit = True


TINY_PROMPTS = [[1 + i % 13, 2, 3 + i % 5, 7, (3 * i) % 16] for i in range(6)]
OFFLINE_NEW = 64


@pytest.fixture(scope="module")
def offline_tiny():
  """Offline plain greedy generation of each TINY_PROMPTS prompt alone (OFFLINE_NEW tokens, no stop token)."""
  from specjax.engine.decode import generate_plain
  return [generate_plain(TINY_PARAMS, TINY_LLAMA, [p], max_new_tokens=OFFLINE_NEW).tokens[0]
          for p in TINY_PROMPTS]


BUCKET_NEW = [4, 8, 12, 24, 40, 64]     # max_tokens: staggered ends, so the live slots pass through the buckets
STOP = 0                                 # a stop token that offline greedy reaches mid-stream in requests 1-4
SEND_ORDER = {"together": [0] * 6, "reversed": [5, 4, 3, 2, 1, 0], "shuffled": [3, 0, 5, 1, 4, 2]}   # x 20 ms


class _StopTokens:
  """TINY_LLAMA's token ids shown as letters, with STOP as the end of a turn."""
  eos_ids = (STOP,)

  def decode(self, ids):
    return "".join(chr(97 + t) for t in ids)


def _expected(want: list[int], n: int) -> tuple[list[int], str]:
  """Offline greedy tokens of a request with max_tokens n and stop token STOP -> (tokens, finish reason)."""
  if STOP in want[:n]:
    return want[:want.index(STOP) + 1], "stop"
  return want[:n], "length"


def _bucket_server(speculator, call_ms=None):
  """A 4-slot server over TINY_LLAMA (stop token STOP) with buckets of 1, 2 and 4 rows and up to
  4 rounds per device call: plain decoding, device ngram_simple, a random MTP head, or host
  ngram_simple ("ngram_host")."""
  from specjax.drafters.mtp import init_heads
  target = LoadedModel("tiny", TINY_LLAMA, TINY_PARAMS, tokenizer=_StopTokens())
  extra = {"ngram_simple": {"options": {"size_n": 2}}, "mtp": {"head": init_heads(TINY_LLAMA, 2, seed=1)},
           "ngram_host": {"options": {"size_n": 2, "device": False}}, None: {}}[speculator]
  server = build_server(target, speculator and speculator.replace("_host", "_simple"), slots=4, capacity=128,
                        n_max=2, buckets=(1, 2), rounds_per_call=4, call_ms=call_ms, **extra)
  assert server.scheduler.engine.buckets == (1, 2, 4)
  assert speculator != "ngram_host" or not server.scheduler.engine.drafter.on_device
  return server


@pytest.mark.parametrize("speculator,order,call_ms", [(None, "together", None), ("ngram_simple", "reversed", None),
                                                      ("mtp", "shuffled", None), ("ngram_host", "together", None),
                                                      ("mtp", "together", 1000.0)])
def test_buckets_and_multi_round_calls_stay_lossless(offline_tiny, speculator, order, call_ms):
  """Six greedy requests streamed through the openai client into 4 slots, sent together or one
  by one in some order: as requests end (at their max_tokens or at the stop token, mostly inside a
  call's rounds) and queued ones join, the rounds switch buckets (which ones depends on this
  machine's timing; `test_every_bucket_lossless_call_by_call` runs each for certain), and each
  request's tokens and finish reason equal offline greedy generation of its prompt alone. Calls
  ran several rounds (a chunk carries several rounds' tokens); the metrics count every round's
  tokens and every request's finish reason; every slot is free at the end. With a call time budget
  (`call_ms`, generous here) a bucket's first call runs one round, the later ones several."""
  import openai
  server = _bucket_server(speculator, call_ms)
  engine = server.scheduler.engine
  http, url = run_in_thread(server.app())
  try:
    clients = [openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) for _ in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
      streams = list(pool.map(lambda i: _openai_completion(clients[i], i, 0.02 * SEND_ORDER[order][i]), range(6)))
    metrics = httpx.get(f"{url}/metrics").text
    _wait(lambda: server.scheduler.running() == 0)
  finally:
    http.should_exit = True
  expected = [_expected(want, n) for want, n in zip(offline_tiny, BUCKET_NEW)]
  for (ids, _, finish, usage), (want, reason) in zip(streams, expected):
    assert (ids, finish) == (want, reason)
    assert usage.completion_tokens == len(ids)
    if speculator is None:
      assert usage.model_extra["speculative"]["rounds"] == len(ids) - 1
  assert {r for _, r in expected} == {"stop", "length"}
  rounds = {b: float(x) for b, x in re.findall(r'specjax_rounds_at_batch_total\{batch="(\d+)"\} (\S+)', metrics)}
  assert rounds and set(rounds) <= {"1", "2", "4"}, rounds
  calls = float(re.search(r"^specjax_device_calls_total (\S+)$", metrics, re.M).group(1))
  if engine.rounds_max > 1:
    assert calls < sum(rounds.values())                                 # some calls ran more than one round
    assert max(len(c) for _, chunks, _, _ in streams for c in chunks) > 1 + engine.max_draft
  generated = float(re.search(r"^specjax_generated_tokens_total (\S+)$", metrics, re.M).group(1))
  assert generated == sum(len(ids) - 1 for ids, *_ in streams)          # every token after the prefill's
  for reason in ("stop", "length"):
    n = sum(r == reason for _, r in expected)
    assert f'specjax_requests_total{{reason="{reason}"}} {n}.0' in metrics
  assert not engine.live.any()


def _openai_completion(client, i: int, delay: float = 0.0):
  """Request i (TINY_PROMPTS[i], BUCKET_NEW[i] tokens), greedy, streamed through the openai
  `client` after `delay` seconds -> (token ids, the ids of each chunk, finish reason, usage)."""
  threading.Event().wait(delay)
  ids, chunks, finish, usage = [], [], None, None
  for chunk in client.completions.create(model="tiny", prompt=TINY_PROMPTS[i], max_tokens=BUCKET_NEW[i],
                                         temperature=0.0, stream=True, stream_options={"include_usage": True}):
    usage = chunk.usage or usage
    for c in chunk.choices:
      new = (c.model_extra or {}).get("token_ids") or []
      ids += new
      chunks += [new] if new else []
      finish = c.finish_reason or finish
  return ids, chunks, finish, usage


def test_every_bucket_lossless_call_by_call(offline_tiny):
  """The scheduler driven one iteration at a time (no thread: the live slots are exactly known)
  with a random MTP head: request 5 alone runs a batch-1 call, with request 4 a batch-2 call, then
  with the other four (two waiting for a slot) batch-4 calls, fewer buckets again as they end;
  every request's tokens and finish reason equal offline greedy generation of its prompt alone."""
  sched = _bucket_server("mtp").scheduler
  step, batches, events = sched.engine.step, [], {i: [] for i in range(6)}

  def counted(rounds):
    out = step(rounds)
    batches.append(out.batch)
    return out
  sched.engine.step = counted
  for stage in ([5], [4], [0, 1, 2, 3]):
    for i in stage:
      sched.submit(GenRequest(TINY_PROMPTS[i], max_tokens=BUCKET_NEW[i]), events[i].append)
    sched._iteration()
  while sched.running() or sched.queue_length() or sched._joining:
    sched._iteration()
  assert batches[:3] == [1, 2, 4] and batches[-1] == 1, batches
  for i, want in enumerate(offline_tiny):
    tokens = sum((e.get("tokens", []) for e in events[i]), [])
    assert (tokens, events[i][-1]["finish_reason"]) == _expected(want, BUCKET_NEW[i])
  assert not sched.engine.live.any()


def test_cancel_within_one_call():
  """A request cancelled when its first tokens arrive gets at most one more call's tokens (the
  call that was running), ends "cancelled", and its slot is free again; the model thread keeps
  serving: a request done at its first token (max_tokens 1) and one beside it complete in full,
  and every slot is free after them."""
  target = LoadedModel("tiny", TINY_LLAMA, TINY_PARAMS)
  sched = build_server(target, "ngram_simple", slots=2, capacity=128, n_max=4, options={"size_n": 2}).scheduler
  engine = sched.engine
  events, done = [], []

  def sink(e):
    events.append(e)
    if "tokens" in e and len(events) == 1:
      sched.cancel(handle)
  handle = sched.submit(GenRequest([1, 2, 3], max_tokens=100), sink)
  sched.start()
  try:
    _wait(lambda: handle.finished)
    tokens = sum(len(e.get("tokens", [])) for e in events)
    assert events[-1]["finish_reason"] == "cancelled" and 1 <= tokens <= 1 + engine.rounds_max * (engine.max_draft + 1)
    assert sched.running() == 0 and not engine.live.any()
    one = []
    sched.submit(GenRequest([4, 5], max_tokens=1), one.append)
    sched.submit(GenRequest([4, 5], max_tokens=9), done.append)
    _wait(lambda: all(x and "finish_reason" in x[-1] for x in (one, done)))
    tokens = [sum((e.get("tokens", []) for e in x), []) for x in (one, done)]
    assert one[-1]["finish_reason"] == done[-1]["finish_reason"] == "length"
    assert len(tokens[0]) == 1 and len(tokens[1]) == 9 and tokens[1][0] == tokens[0][0]
    _wait(lambda: sched.running() == 0)
    assert not engine.live.any()
  finally:
    sched.stop()


def _wait(ready, seconds: float = 60.0) -> None:
  for _ in range(int(seconds / 0.05)):
    if ready():
      return
    threading.Event().wait(0.05)
  raise TimeoutError("the model thread did not answer")


class _Slots:
  """The parts of a `SlotEngine` the scheduler's choice of rounds per call reads."""
  b, chunk, rounds_max, max_draft, max_tokens_per_round = 2, 64, 8, 3, 4

  def bucket_size(self) -> int:
    return self.b


def test_rounds_per_call_follow_waiting_requests():
  """The engine's most rounds per call while nothing waits; one while a prompt is prefilled in
  chunks; while requests wait for a full batch, the rounds until a running request is expected to
  end: its tokens left at its slot's tokens per round, once the slot has run a few rounds (before
  that the pooled figure of the running slots; with no rounds yet, the most a round emits)."""
  sched = Scheduler(_Slots(), max_queue=4)
  assert sched._next_rounds() == 8
  a, b = (sched.submit(GenRequest([1], max_tokens=n), lambda e: None) for n in (40, 100))
  sched._waiting.clear()
  sched._slots = [a, b]
  a.n_out = 30                                             # 10 tokens left: 3 rounds of 4 at the fastest
  sched._waiting.append(sched.submit(GenRequest([1]), lambda e: None))
  assert sched._next_rounds() == 3
  sched._counters.rounds[:] = [10, 10]                   # a emitted 2 per round: 5 rounds; b 1 per round: 70
  sched._counters.emitted[:] = [20, 10]
  assert sched._next_rounds() == 5
  sched._counters.rounds[:] = [2, 10]                    # a too new to tell: the pooled 30 / 12 per round, 4 rounds
  assert sched._next_rounds() == 4
  sched._joining.append((sched._waiting.popleft(), None))
  assert sched._next_rounds() == 1


def test_call_time_budget_caps_rounds_per_call():
  """With `call_ms`, a bucket's first call runs one round; then as many rounds as fit the budget at
  the bucket's running ms per round (the latest call weighing half), never more than the engine's
  most, at least one; the waiting-request rule still applies under the cap. Without it: the most."""
  assert Scheduler(_Slots(), max_queue=4)._next_rounds() == 8
  sched = Scheduler(_Slots(), max_queue=4, call_ms=10.0)
  assert sched._next_rounds() == 1
  sched._observe_call(2, 0.004, 1)                     # 4 ms per round (a call's fixed cost in one round)
  assert sched._next_rounds() == 2
  sched._observe_call(2, 0.005, 2)                     # 2.5 ms per round: running (4 + 2.5) / 2 = 3.25
  assert sched._next_rounds() == 3
  sched._observe_call(1, 0.0001, 1)                    # another bucket's calls leave this one's figure
  assert sched._next_rounds() == 3
  for _ in range(20):
    sched._observe_call(2, 0.0001, 1)
  assert sched._next_rounds() == 8                     # cheap rounds: the engine's most binds
  sched._observe_call(2, 1.0, 1)
  sched._observe_call(2, 1.0, 1)
  assert sched._next_rounds() == 1                     # dearer than the budget: still one round
  a, b = (sched.submit(GenRequest([1], max_tokens=n), lambda e: None) for n in (40, 100))
  sched._waiting.clear()
  sched._slots = [a, b]
  sched._round_ms[2] = 1.0
  a.n_out = 30
  sched._waiting.append(sched.submit(GenRequest([1]), lambda e: None))
  assert sched._next_rounds() == 3                     # the waiting rule (3) under the cap (8)
  with pytest.raises(ValueError, match="call_ms"):
    Scheduler(_Slots(), call_ms=0.0)
