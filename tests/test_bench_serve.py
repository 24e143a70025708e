"""bench-serve: its configs (a bench config plus a checked serve: section), its per-level numbers
and plot, and a run end to end against a tiny in-process server with the clients in processes of
their own."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_LLAMA, random_params
from specjax.models.load import LoadedModel
from specjax.serve.cli import build_server

TINY_PARAMS = random_params(TINY_LLAMA, seed=0)


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
  assert spec_from_dict({**data, "serve": {"call_ms": 40}}).serve.call_ms == 40
  with pytest.raises(ConfigError, match="serve.call_ms"):
    spec_from_dict({**data, "serve": {"call_ms": 0}})
  cfg = BenchServeConfig(methods=[None], concurrency=[1, 64], rates=[], num_prompts=16, prompts_per_client=2)
  assert cfg.requests_at("concurrency", 1) == 16 and cfg.requests_at("concurrency", 64) == 128
  assert request_fields(spec_from_dict(data).experiment.methods[0]) == {"speculative": {"n_min": 1}}
  assert request_fields(None) == {}


class _ChatTokens:
  """Chat prompts as token ids of TINY_LLAMA's vocabulary, and back as letters."""

  eos_ids = ()

  def encode_chat(self, messages):
    return [1] + [2 + ord(c) % 13 for c in messages[-1]["content"]][:20]

  def decode(self, ids):
    return "".join(chr(97 + t) for t in ids)


def test_bench_serve_clients_in_processes(tmp_path):
  """bench-serve's levels split over client processes (clients dealt out evenly, each sending its
  own prompts; a rate split evenly) and run end to end against a tiny server from 2 processes:
  every request answered in full, the server's device calls and rounds by bucket in each row, its
  prefill calls and the prompt pieces they took (one per request: the prompts are short), no
  compilation during a timed level (warm-up compiled everything), and the model thread's time by
  part within the level's wall time."""
  from specjax.serve.bench_serve import BenchServeConfig, run_bench, shares
  prompts = [f"p{i}" for i in range(7)]
  split = shares(prompts, "concurrency", 3, 2)
  assert split == [(2, ["p0", "p3", "p6", "p2", "p5"]), (1, ["p1", "p4"])]
  assert shares(prompts, "rate", 4.0, 2) == [(2.0, ["p0", "p2", "p4", "p6"]), (1.0 * 2, ["p1", "p3", "p5"])]
  questions = tmp_path / "q.jsonl"
  questions.write_text("".join(json.dumps({"turns": [f"question {i}"]}) + "\n" for i in range(5)))
  target = LoadedModel("tiny", TINY_LLAMA, TINY_PARAMS, tokenizer=_ChatTokens())
  cfg = BenchServeConfig(methods=[None], concurrency=[1, 3], rates=[], num_prompts=5, max_tokens=6,
                         dataset=str(questions), out=str(tmp_path / "b"), client_processes=2)
  result = run_bench(cfg, lambda m: build_server(target, None, slots=4, capacity=128, rounds_per_call=4))
  rows = result["rows"]
  assert [r["client_processes"] for r in rows] == [1, 2]
  for r in rows:
    assert r["ok"] == r["requests"] == 5 and r["output_tokens"] == 5 * 6 and r["throughput_tok_s"] > 0
    assert 0 < r["device_calls"] <= sum(r["rounds_by_batch"].values())
    assert 0 < r["prefill_calls"] <= r["prefill_rows"] == 5     # every request's prompt in one piece (short prompts)
    assert r["compiles"] == 0 and r["compile_s"] == 0, r
    parts = r["model_thread_s"]
    assert set(parts) == {"rounds", "prefill", "host"} and parts["rounds"] > 0
    assert sum(parts.values()) <= r["seconds"] + 1.0      # the thread's iterations straddle the level's edges
    step = r["step_s"]                                    # the calls of rounds by part: within their whole
    assert {"call", "fetch", "step"} <= set(step) and step["call"] > 0, step
    assert step["call"] + step["fetch"] <= step["step"] + 2e-3 and step["step"] <= parts["rounds"] + 2e-3, (step, parts)
  saved = json.loads((tmp_path / "b.json").read_text())
  assert saved["rows"][1]["concurrency"] == 3
  warm = saved["warm_up"]["plain"]               # where the server's warm-up went, by phase
  assert warm["programs"] > 0 and 0 < warm["trace_s"] <= warm["wall_s"] <= warm["total_s"] and warm["build_s"] >= 0
