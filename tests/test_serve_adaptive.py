"""Adaptive drafting in the server (`specjax.serve.adaptive_slots`): over the live slots, several
rounds per device call, every request's greedy output equals offline greedy generation of its
prompt alone whatever widths the batch ran, per-request speculative fields stay per request, and a
drafter that never lands is dropped to plain decoding steps."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from conftest import TINY_LLAMA, random_params
from specjax.models.load import LoadedModel
from specjax.serve.app import run_in_thread
from specjax.serve.bench_serve import adaptive_state
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
  the limited one drafts at most one token a round, while the others do speculate; /metrics shows
  the controller's cost and replayed tokens per round at every width. Costs are fixed
  in the config, so the widths follow acceptance only, not this machine's timing."""
  target = LoadedModel("tiny", TINY_LLAMA, TINY_PARAMS)
  server = build_server(target, "ngram_simple", slots=4, capacity=128, n_max=4, options={"size_n": 2},
                        adaptive={"costs": [1.0, 1.2, 1.4, 1.8]})
  http, url = run_in_thread(server.app())
  try:
    fields = [None, None, {"enabled": False}, {"n_max": 1}, None, None]
    out = _all_at_once(url, fields)
    metrics_text = httpx.get(f"{url}/metrics").text
  finally:
    http.should_exit = True
  for body, want in zip(out, offline_tiny):
    assert body["choices"][0]["token_ids"] == want
  # /metrics shows the controller's costs and replayed tokens per round by width (bench-serve keeps them)
  state = adaptive_state(metrics_text)
  control = server.scheduler.engine.control
  assert state["round_ms"]["all"] == {str(w): c for w, c in zip(control.widths, [1.0, 1.2, 1.4, 1.8])}
  assert set(state["tau"]) == {str(w) for w in control.widths} and all(t >= 1.0 for t in state["tau"].values())
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
  gives a positive cost for every width, each from calls of as many rounds as the server's
  (`rounds_max`: the free slots of the copy it times are marked not done and their token budgets
  lifted, else a call would end before, or after, its first round), and a call of one round gives
  the fixed cost of a call, which the costs leave out."""
  from specjax.drafters.mtp import init_heads
  target = LoadedModel("tiny", TINY_LLAMA, TINY_PARAMS)
  server = build_server(target, "mtp", head=init_heads(TINY_LLAMA, 2, seed=1), slots=4, capacity=128, n_max=2,
                        adaptive={"widths": [0, 2], "costs": [1.0, 1.5]})
  engine = server.scheduler.engine
  engine.warm()
  run, ran = engine._run, []
  def counted(*a, **k):
    out = run(*a, **k)
    ran.append(out.rounds)
    return out
  engine._run = counted
  measured = engine.round_costs(repeats=1)
  del engine._run
  # 2 widths x (1 untimed + 1 timed) calls of rounds_max rounds, then one call of a round for the fixed cost
  assert engine.rounds_max > 1 and ran == [engine.rounds_max] * 4 + [1], ran
  assert measured.shape == (2,) and (measured > 0).all() and engine.control.costs.tolist() == [1.0, 1.5]
  assert engine.call_fixed_ms >= 0.0 and engine.control.call_ms == 0.0     # fixed config costs stay as given
  http, url = run_in_thread(server.app())
  try:
    out = _all_at_once(url, [None] * len(ADAPTIVE_PROMPTS))
    calls = _metric(url, "specjax_device_calls_total")
    metrics_text = httpx.get(f"{url}/metrics").text
  finally:
    http.should_exit = True
  for body, want in zip(out, offline_tiny):
    assert body["choices"][0]["token_ids"] == want
  widths = engine.control.rounds_by_width
  assert widths[0] >= 0.75 * sum(widths.values()) and calls < sum(widths.values()), (widths, calls)
  # why calls ran fewer rounds than the scheduler asked: counted per rule, on /metrics for bench-serve
  # (6 requests on 4 slots: each join leaves a fresh slot, whose first rounds cut the calls)
  cuts = engine.control.calls_cut
  assert adaptive_state(metrics_text)["calls_cut"] == cuts and set(cuts) <= {"fresh", "explore", "probe"}
  assert cuts.get("fresh", 0) > 0 and sum(cuts.values()) <= calls, (cuts, calls)
  for body in out:
    u = body["usage"]["speculative"]
    assert u["draft_tokens"] <= 2 * 8 and u["accepted_tokens"] <= u["draft_tokens"] // 2, u


def test_round_costs_leave_the_call_fixed_cost_out():
  """A width's rounds measure the same whatever the length of the call they ran in (the call's fixed
  cost apart, `SlotEngine._round_ms`), and the rule prices a width at its round plus the fixed cost
  shared by the planned call's rounds (`plan_costs`): short calls make every width dearer by the
  same amount, not the width that happened to run in them."""
  from specjax.engine.adaptive import AdaptiveConfig
  from specjax.serve.adaptive_slots import RoundCosts
  from specjax.serve.engine_adapter import SlotEngine
  engine = SlotEngine.__new__(SlotEngine)            # `_round_ms` reads only the fixed cost
  engine.call_fixed_ms = 2.0
  assert engine._round_ms(10.0, 8) == engine._round_ms(3.0, 1) == pytest.approx(1.0)
  assert engine._round_ms(2.0, 1) == pytest.approx(0.2)       # never below a tenth of the call's time per round
  costs = RoundCosts(AdaptiveConfig(), (0, 4))
  costs.set_costs([1.0, 1.5], call_ms=engine.call_fixed_ms)
  assert costs.plan_costs(None, 1).tolist() == [3.0, 3.5]
  assert costs.plan_costs(None, 4).tolist() == [1.5, 2.0]
  costs.observe_cost(4, engine._round_ms(2.0 + 1.5, 1), None)   # a width-4 round in a one-round call
  assert costs.costs.tolist() == pytest.approx([1.0, 1.5])


def test_fresh_slots_shorten_calls_only_while_many():
  """Without replay, a plan covers no more rounds than the freshest slots have been observed, while
  a quarter or more of the live slots are fresh; one new request among eight long-running ones does
  not shorten the call (under load a request joins at almost every call)."""
  import types
  from specjax.engine.adaptive import AdaptiveConfig
  from specjax.serve.adaptive_slots import SlotWidthController
  drafter = types.SimpleNamespace(max_draft=2, on_device=True, replayable=False)
  control = SlotWidthController(AdaptiveConfig(), 8, drafter, rounds_per_call=8)
  control.set_costs([1.0, 1.1, 1.2])
  live, n_max, n_min = np.ones(8, bool), np.full(8, 2), np.zeros(8, np.int64)
  control._since_join[:] = 20
  control.round = 10                                   # past the first exploring stretch
  assert control.plan(n_max, n_min, live, rounds=8).rounds == 8
  control.join(3, 5)                                    # one fresh slot of eight: the call keeps its rounds
  control.round = 10
  assert control.plan(n_max, n_min, live, rounds=8).rounds == 8
  for slot in (4, 5):                                   # three of eight: the freshest one's rounds
    control.join(slot, 5)
  control._since_join[[3, 4, 5]] = [6, 2, 3]
  control.round = 10
  assert control.plan(n_max, n_min, live, rounds=8).rounds == 2
  control.round = 10
  assert control.plan(n_max, n_min, live & (np.arange(8) != 4), rounds=8).rounds == 3    # a finished slot is not fresh


def _metric(url: str, name: str, **labels) -> float:
  """One sample of the server's /metrics (0.0 when absent)."""
  want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
  for line in httpx.get(f"{url}/metrics").text.splitlines():
    if line.startswith(want + " "):
      return float(line.split()[-1])
  return 0.0


# ----------------------------------------------------------------------------------------------
# trees: adaptive node budgets (`specjax.serve.adaptive_tree_slots`)


def test_served_tree_budgets_tally_as_the_offline_loop():
  """What a round shows per budget, read on the host (numpy) off the accepted path's ranks as
  `run_rounds` reports them (PAST_PATH past the path), equals the offline loop's `BudgetTally` (jax,
  from the verdict's ranks) on the same rounds."""
  import types

  import jax.numpy as jnp
  import numpy as np

  from specjax.engine.adaptive_tree import BudgetTally
  from specjax.engine.adaptive_tree import PAST_PATH, accepted_by_budget
  rng = np.random.default_rng(0)
  widths = (0, 4, 8, 16)
  for _ in range(20):
    b, d = 6, 5
    path_rank = rng.integers(0, 20, size=(b, d)).astype(np.int32)
    n_acc = rng.integers(0, d + 1, size=b).astype(np.int32)
    on_path = np.arange(d)[None, :] < n_acc[:, None]
    served = accepted_by_budget(np.where(on_path, path_rank, PAST_PATH), widths)             # [W, B], on the host
    verdict = types.SimpleNamespace(path_rank=jnp.where(on_path, path_rank, -1), n_accepted=jnp.asarray(n_acc),
                                    live=jnp.ones((b,), bool))
    tally = BudgetTally.init(len(widths), b).observe(widths, 16, verdict)
    np.testing.assert_array_equal(1 + served, np.asarray(tally.tokens))


def test_tree_budget_rule_follows_acceptance_and_probes_up():
  """The controller's plan: the first explore_rounds rounds at the widest budget; then the budget
  with the most expected tokens per ms (slots that showed long accepted paths at budget 8 pick it
  over plain steps at these costs; slots that accepted nothing pick 0, rounds that draft nothing);
  every explore_every-th call a one-round probe one budget up; a slot with speculation off never
  drafts; a joining slot restarts from the batch's pooled estimate."""
  import numpy as np

  from specjax.engine.adaptive import AdaptiveConfig
  from specjax.serve.adaptive_tree_slots import SlotBudgetController

  class Tree:
    max_draft, budgeted, proposes_tree, on_device = 8, True, True, True

  ac = AdaptiveConfig(costs=(1.0, 1.2, 1.5), explore_rounds=2, explore_every=4)
  live, n_max, n_min = np.ones(3, bool), np.array([3, 3, 0]), np.zeros(3, int)
  for accepted_depth, want in ((3, 8), (0, 0)):
    c = SlotBudgetController(ac, 3, Tree(), rounds_per_call=8)
    assert c.widths == (0, 4, 8)
    first = c.plan(n_max, n_min, live, rounds=8)
    assert (first.width, first.rounds, first.lengths.tolist()) == (8, 2, [3, 3, 0])
    ranks = np.full((3, 3), 2 ** 30)
    ranks[:, :accepted_depth] = np.arange(accepted_depth) * 2            # ranks 0, 2, 4: every budget >= 4 holds the path
    for _ in range(12):
      c.observe(first, 8, None, None, live, 1.0, None, None, ranks=ranks)
    plans = [c.plan(n_max, n_min, live, rounds=8) for _ in range(4)]
    assert [p.width for p in plans[:3]] == [want] * 3, [p.width for p in plans]
    if want == 0:
      assert (plans[3].width, plans[3].rounds) == (4, 1)                # the probe, one budget up, one round
    else:
      assert (plans[3].width, plans[3].rounds) == (8, 8)                # no budget above the widest to probe
    assert all(p.lengths[2] == 0 for p in plans)
  c.join(0, 10)
  assert c.rounds[:, 0].sum() == 0 and c.tokens[:, 0].sum() == 0
  np.testing.assert_allclose(c.tau()[:, 0], c.tokens.sum(1) / c.rounds.sum(1))   # the batch's pooled estimate


def test_adaptive_tree_lossless_and_drops_a_tree_that_never_lands(offline_tiny):
  """A DFlash tree drafter with a random head (its trees almost never hold the target's tokens),
  budgets 0, 4 and 8 at fixed costs (a budget-8 round costs 1.5 plain steps): served to 6
  concurrent requests over 4 slots, every request equals offline greedy generation of its prompt
  alone, the first rounds explore the widest budget and most rounds then run at budget 0. A round
  emits at most depth + 1 tokens (the scheduler's waiting rule counts rounds by it)."""
  from specjax.drafters.registry import _example_dflash
  target = LoadedModel("tiny", TINY_LLAMA, TINY_PARAMS)
  example = _example_dflash(target, None, depth=3, top_k=2, n_nodes=8)
  server = build_server(target, "dflash_tree", head=example["head"], slots=4, capacity=128, n_max=2,
                        options={"depth": 3, "top_k": 2, "n_nodes": 8}, adaptive={"costs": [1.0, 1.2, 1.5]})
  engine = server.scheduler.engine
  assert engine.control.widths == (0, 4, 8)
  assert engine.max_tokens_per_round == 3 + 1      # a round emits at most the tree's depth + 1, not its 8 nodes + 1
  http, url = run_in_thread(server.app())
  try:
    out = _all_at_once(url, [None] * len(ADAPTIVE_PROMPTS))
  finally:
    http.should_exit = True
  for body, want in zip(out, offline_tiny):
    assert body["choices"][0]["token_ids"] == want
  widths = engine.control.rounds_by_width
  # most rounds at budget 0 (how many exactly depends on when the requests' HTTP calls land)
  assert widths[8] >= engine.control.ac.explore_rounds and widths[0] > 0.5 * sum(widths.values()), widths


def test_shadow_drafts_stand_in_for_exploring_in_the_servers_controllers():
  """Where width-0 calls report shadow drafts (`shadowed`), neither controller explores: the chain
  controller's plans never make every slot draft its whole n_max once width 0 is chosen (without
  them its exploring stretches do), and a width-0 round's shadow drafts move the slots' acceptance
  as verified drafts of those lengths would; the tree controller never probes a budget up, and a
  budget-0 round's shadow trees show every budget, as a round at the widest budget does."""
  from specjax.engine.adaptive import AdaptiveConfig
  from specjax.serve.adaptive_slots import SlotWidthController
  from specjax.serve.adaptive_tree_slots import SlotBudgetController

  class Chain:
    max_draft, on_device, replayable, proposes_tree = 3, True, False, False

  class Tree:
    max_draft, budgeted, proposes_tree, on_device = 8, True, True, True

  ac = AdaptiveConfig(costs=(1.0, 5.0, 6.0, 7.0), explore_rounds=2, explore_every=2, segment_rounds=4)
  live, n_max, n_min = np.ones(4, bool), np.full(4, 3), np.zeros(4, int)
  drafted = {}
  for shadowed in (True, False):
    c = SlotWidthController(ac, 4, Chain(), rounds_per_call=4, shadowed=shadowed)
    plans = []
    for _ in range(12):
      plan = c.plan(n_max, n_min, live, rounds=4)
      plans.append(plan)
      for _ in range(plan.rounds):
        c.observe(plan, plan.width, np.zeros(4, int), np.zeros(4, int), live, 1.0, None, None)
    drafted[shadowed] = [p.width for p in plans]
  assert all(w == 0 for w in drafted[True]), drafted
  assert sum(w == 3 for w in drafted[False]) >= 3, drafted            # an exploring stretch every 8 rounds
  c = SlotWidthController(ac, 4, Chain(), rounds_per_call=4, shadowed=True)
  before = c.acceptance.alpha.copy()
  plan = c.plan(n_max, n_min, live, rounds=4)
  shadow = np.asarray([[3, 3, 1, 2], [3, 3, 0, 0]])                   # slots 0, 1 matched 3 of 3; 2, 3 missed
  c.observe(plan, 0, np.zeros(4, int), np.zeros(4, int), live, 1.0, None, None, shadow=shadow)
  after = c.acceptance.alpha
  assert (after[:2] > before[:2]).all() and (after[2:] < before[2:]).all(), (before, after)
  assert c.rates.asked[0] > c.rates.asked[2]                          # position 1 observed in every slot

  tree_ac = AdaptiveConfig(costs=(1.0, 5.0, 6.0), explore_rounds=1, explore_every=2)
  t = SlotBudgetController(tree_ac, 3, Tree(), rounds_per_call=8, shadowed=True)
  first = t.plan(n_max[:3], n_min[:3], live[:3], rounds=8)
  assert first.width == 8                                             # the first stretch explores, as offline
  t.observe(first, 8, None, None, live[:3], 1.0, None, None, ranks=np.full((3, 3), 2 ** 30))
  widths = [t.plan(n_max[:3], n_min[:3], live[:3], rounds=8).width for _ in range(6)]
  assert widths == [0] * 6, widths                                   # no probes one budget up
  ranks = np.full((3, 3), 2 ** 30)
  ranks[0, :2] = [0, 5]                                              # slot 0's shadow path: ranks 0, 5
  before = t.tokens.copy()
  t.observe(first, 0, None, None, live[:3], 1.0, None, None, ranks=ranks, shadow=np.asarray([[1, 1, 0], [2, 0, 0]]))
  gained = t.tokens - before * t._decay
  assert gained[:, 0].tolist() == pytest.approx([1.0, 2.0, 3.0])    # budget 0: 1, budget 4: rank 0 only, 8: both
  assert gained[:, 1].tolist() == pytest.approx([1.0, 1.0, 1.0]) and gained[1:, 2].tolist() == [0.0, 0.0]
