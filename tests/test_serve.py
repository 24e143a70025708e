"""The server: continuous batching is lossless per request (streamed greedy tokens through the
official `openai` client equal offline greedy generation of each prompt alone), per-request
speculative fields change only that request's drafting, a bounded load test (valid, cancelled and
malformed requests) leaves the server healthy with every valid request answered, a full queue
answers 429 over HTTP, and adaptive drafting over the live batch stays lossless and drops a
drafter that never lands."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json

import httpx
import pytest

from conftest import TINY_LLAMA, random_params
from specjax.models.load import LoadedModel
from specjax.serve.app import run_in_thread
from specjax.serve.cli import build_server
from specjax.serve.scheduler import GenRequest, QueueFull, Scheduler

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
  health = httpx.get(f"{url}/health").json()
  assert health["status"] == "ok" and health["waiting"] == 0
  metrics = httpx.get(f"{url}/metrics").text
  for name in ("specjax_tokens_per_second", "specjax_tau", "specjax_acceptance_by_position",
               "specjax_queue_length", "specjax_running_slots"):
    assert name in metrics
  assert 'specjax_requests_total{reason="cancelled"}' in metrics


def test_full_queue_refuses(tiny_server):
  """Past max_queue waiting requests, submit raises QueueFull (HTTP 429)."""
  server, _ = tiny_server
  sched = Scheduler(server.scheduler.engine, max_queue=1)       # not started: nothing leaves the queue
  sched.submit(GenRequest([1, 2]), lambda e: None)
  with pytest.raises(QueueFull):
    sched.submit(GenRequest([1, 2]), lambda e: None)


def test_bench_serve_summary_and_plot(tmp_path):
  """bench-serve's per-level numbers (TTFT, TPOT after the first token, tau without the prefill's
  token) and its plot of throughput against concurrency."""
  from specjax.serve.bench_serve import Sample, plot, summarize
  row = summarize([Sample(True, ttft=0.5, latency=1.5, n_out=11, rounds=5), Sample(False)], wall=2.0)
  assert row["ok"] == 1 and row["throughput_tok_s"] == 5.5 and row["tau"] == 2.0
  assert row["tpot_s"]["mean"] == pytest.approx(0.1) and row["ttft_s"]["p50"] == 0.5
  rows = [{"method": m, "concurrency": c, "throughput_tok_s": t} for m, c, t in
          [("plain", 1, 10), ("plain", 8, 50), ("ngram_simple", 1, 15), ("ngram_simple", 8, 60)]]
  plot(rows, tmp_path / "b.png")
  assert (tmp_path / "b.png").stat().st_size > 1000


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


ADAPTIVE_PROMPTS = [[1 + i % 13, 2, 3 + i % 5, 7, (3 * i) % 16] for i in range(6)]
ADAPTIVE_NEW = 48


@pytest.fixture(scope="module")
def offline_tiny():
  """Offline plain greedy generation of each ADAPTIVE_PROMPTS prompt alone."""
  from specjax.engine.decode import generate_plain
  return [generate_plain(TINY_PARAMS, TINY_LLAMA, [p], max_new_tokens=ADAPTIVE_NEW).tokens[0]
          for p in ADAPTIVE_PROMPTS]


def _all_at_once(url: str, speculative: list[dict | None]) -> list[dict]:
  """ADAPTIVE_PROMPTS sent together, greedy, each with its `speculative` field -> response bodies."""
  bodies = [{"prompt": p, "max_tokens": ADAPTIVE_NEW, "temperature": 0.0, **({"speculative": s} if s else {})}
            for p, s in zip(ADAPTIVE_PROMPTS, speculative)]
  answers = asyncio.run(_completions(url, bodies))
  assert all(r.status_code == 200 for r in answers)
  return [r.json() for r in answers]


def test_adaptive_lossless_and_fields_stay_per_request(offline_tiny):
  """Adaptive drafting (device ngram_simple, replayed acceptance) over 4 slots and 6 requests, one
  with speculation off and one limited to one draft token: every request equals offline greedy
  generation of its prompt alone, whatever widths the batch ran; the off request never drafts and
  the limited one drafts at most one token a round, while the others do speculate. Costs are fixed
  in the config, so the widths follow acceptance only, not this machine's timing."""
  target = LoadedModel("tiny", TINY_LLAMA, TINY_PARAMS)
  server = build_server(target, "ngram_simple", slots=4, capacity=128, n_max=4, options={"size_n": 2},
                        adaptive={"costs": [1.0, 1.2, 1.4, 1.8]})
  http, url = run_in_thread(server.app())
  try:
    fields = [None, None, {"enabled": False}, {"n_max": 1}, None, None]
    out = _all_at_once(url, fields)
  finally:
    http.should_exit = True
  for body, want in zip(out, offline_tiny):
    assert body["choices"][0]["token_ids"] == want
  usage = [b["usage"]["speculative"] for b in out]
  assert usage[2]["draft_tokens"] == 0 and usage[2]["rounds"] == ADAPTIVE_NEW - 1
  assert usage[3]["draft_tokens"] <= usage[3]["rounds"]
  assert sum(u["draft_tokens"] for i, u in enumerate(usage) if i not in (2, 3)) > 0
  widths = server.scheduler.engine.control.rounds_by_width
  assert widths[0] > 0 and sum(n for w, n in widths.items() if w > 0) > 0     # both plain steps and rounds


def test_adaptive_drops_a_drafter_that_never_lands(offline_tiny):
  """A randomly initialised MTP head (its drafts are almost never the target's tokens), widths 0
  and 2 with costs timed by the warm-up: after the first rounds of each request the batch runs at
  width 0, and the output is still offline greedy."""
  from specjax.drafters.mtp import init_heads
  target = LoadedModel("tiny", TINY_LLAMA, TINY_PARAMS)
  server = build_server(target, "mtp", head=init_heads(TINY_LLAMA, 2, seed=1), slots=4, capacity=128, n_max=2,
                        adaptive={"widths": [0, 2]})
  engine = server.scheduler.engine
  engine.warm()
  assert engine.control.costs.shape == (2,) and (engine.control.costs > 0).all()
  http, url = run_in_thread(server.app())
  try:
    out = _all_at_once(url, [None] * len(ADAPTIVE_PROMPTS))
  finally:
    http.should_exit = True
  for body, want in zip(out, offline_tiny):
    assert body["choices"][0]["token_ids"] == want
  widths = engine.control.rounds_by_width
  assert widths[0] >= 0.75 * sum(widths.values()), widths
  for body in out:
    u = body["usage"]["speculative"]
    assert u["draft_tokens"] <= 2 * 8 and u["accepted_tokens"] <= u["draft_tokens"] // 2, u


def test_bench_serve_config_methods_and_levels():
  """A bench-serve config: a bench config's methods (some kept by name) plus a checked serve:
  section; requests per level grow with the clients; a method's n_min travels in each request."""
  from specjax.bench.config import ConfigError
  from specjax.serve.bench_config import spec_from_dict
  from specjax.serve.bench_serve import BenchServeConfig, request_fields
  data = {"name": "s", "target": "smollm2-135m-instruct", "methods": [
      {"name": "ng", "speculator": "ngram_simple", "options": {"size_n": 3}, "draft_params": {"n_max": 8, "n_min": 1}},
      {"name": "ng_adaptive", "speculator": "ngram_simple", "adaptive": True}],
      "serve": {"concurrency": [1, 64], "num_prompts": 16, "prompts_per_client": 2}}
  spec = spec_from_dict(data, methods=["ng_adaptive"])
  assert [m.name for m in spec.experiment.methods] == ["ng_adaptive"] and spec.serve.concurrency == (1, 64)
  with pytest.raises(ConfigError, match="no method"):
    spec_from_dict(data, methods=["nope"])
  with pytest.raises(ConfigError, match="serve.slots"):
    spec_from_dict({**data, "serve": {"slots": 0}})
  with pytest.raises(ConfigError, match="unknown key"):
    spec_from_dict({**data, "serve": {"levels": [1]}})
  cfg = BenchServeConfig(methods=[None], concurrency=[1, 64], rates=[], num_prompts=16, prompts_per_client=2)
  assert cfg.requests_at("concurrency", 1) == 16 and cfg.requests_at("concurrency", 64) == 128
  assert request_fields(spec_from_dict(data).experiment.methods[0]) == {"speculative": {"n_min": 1}}
  assert request_fields(None) == {}
