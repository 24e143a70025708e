"""Adaptive drafting in the server (`specjax.serve.adaptive_slots`): over the live slots, several
rounds per device call, every request's greedy output equals offline greedy generation of its
prompt alone whatever widths the batch ran, per-request speculative fields stay per request, and a
drafter that never lands is dropped to plain decoding steps."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import TINY_LLAMA, random_params
from specjax.models.load import LoadedModel
from specjax.serve.app import run_in_thread
from specjax.serve.cli import build_server

TINY_PARAMS = random_params(TINY_LLAMA, seed=0)
ADAPTIVE_PROMPTS = [[1 + i % 13, 2, 3 + i % 5, 7, (3 * i) % 16] for i in range(6)]
ADAPTIVE_NEW = 48


@pytest.fixture(scope="module")
def offline_tiny():
  """Offline plain greedy generation of each ADAPTIVE_PROMPTS prompt alone."""
  from specjax.engine.decode import generate_plain
  return [generate_plain(TINY_PARAMS, TINY_LLAMA, [p], max_new_tokens=ADAPTIVE_NEW).tokens[0]
          for p in ADAPTIVE_PROMPTS]


async def _completions(url: str, bodies: list[dict]) -> list[httpx.Response]:
  """The bodies posted to /v1/completions at once."""
  async with httpx.AsyncClient(base_url=url, timeout=120) as client:
    return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))


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
  and 2 at fixed costs (a round at width 2 costs 1.5 plain steps; measured costs of this tiny model
  on a CPU are all dispatch and say nothing): after its first exploring rounds the batch runs at
  width 0, several rounds per call, and the output is still offline greedy. The warm-up's timing
  gives a positive cost for every width."""
  from specjax.drafters.mtp import init_heads
  target = LoadedModel("tiny", TINY_LLAMA, TINY_PARAMS)
  server = build_server(target, "mtp", head=init_heads(TINY_LLAMA, 2, seed=1), slots=4, capacity=128, n_max=2,
                        adaptive={"widths": [0, 2], "costs": [1.0, 1.5]})
  engine = server.scheduler.engine
  engine.warm()
  measured = engine.round_costs(repeats=1)
  assert measured.shape == (2,) and (measured > 0).all() and engine.control.costs.tolist() == [1.0, 1.5]
  http, url = run_in_thread(server.app())
  try:
    out = _all_at_once(url, [None] * len(ADAPTIVE_PROMPTS))
    calls = _metric(url, "specjax_device_calls_total")
  finally:
    http.should_exit = True
  for body, want in zip(out, offline_tiny):
    assert body["choices"][0]["token_ids"] == want
  widths = engine.control.rounds_by_width
  assert widths[0] >= 0.75 * sum(widths.values()) and calls < sum(widths.values()), (widths, calls)
  for body in out:
    u = body["usage"]["speculative"]
    assert u["draft_tokens"] <= 2 * 8 and u["accepted_tokens"] <= u["draft_tokens"] // 2, u


def _metric(url: str, name: str, **labels) -> float:
  """One sample of the server's /metrics (0.0 when absent)."""
  want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
  for line in httpx.get(f"{url}/metrics").text.splitlines():
    if line.startswith(want + " "):
      return float(line.split()[-1])
  return 0.0
