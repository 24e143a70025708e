"""bench-serve configs: a bench config (target, dtype, prompts, max_new_tokens, sampling, seed,
capacity and the methods, read and checked as `specjax bench` reads them) plus a strict `serve:`
section (the load levels, requests per level, the client processes, and the server's slots, queue,
rounds per device call and batch buckets).

    name: bench_serve_smollm2
    target: smollm2-135m-instruct
    dtype: bfloat16
    prompts: [mt_bench]
    max_new_tokens: 128
    methods:
      - {name: ngram_simple_tuned, speculator: ngram_simple, options: {size_n: 3, size_m: 16},
         draft_params: {n_max: 8, n_min: 1}}
    serve: {concurrency: [1, 8, 32, 64], num_prompts: 16, prompts_per_client: 2, slots: 64}

A method's draft_params.n_max is its server's widest draft; n_min and p_min travel in every
request's `speculative` field; `adaptive` turns on adaptive drafting for its server.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from specjax.bench.config import ConfigError, ExperimentConfig, _build, config_from_dict


@dataclasses.dataclass(frozen=True)
class ServeSettings:
  concurrency: tuple[int, ...] = (1, 8, 32, 64)   # fixed-concurrency levels (clients)
  rates: tuple[float, ...] = ()                   # Poisson arrival rates, requests/s
  num_prompts: int = 64                           # requests per level, at least
  prompts_per_client: int = 0                     # and at least this many per client (concurrency x this)
  slots: int = 64                                 # sequences the server generates together
  max_queue: int = 1024                           # waiting requests before 429
  chunk: int = 256                                # prefill chunk, tokens
  rounds_per_call: int = 8                        # most rounds one device call runs
  buckets: tuple[int, ...] = ()                   # batch sizes the live slots run in (empty: the default)
  call_ms: float | None = None                    # a device call's time budget, ms (None: rounds_per_call alone)
  client_processes: int | None = None             # client processes per level (None: one per 8 clients)
  plain: bool = True                              # measure plain decoding too (first)


@dataclasses.dataclass(frozen=True)
class BenchServeSpec:
  experiment: ExperimentConfig                    # target, prompts, sampling, methods: as `specjax bench` reads them
  serve: ServeSettings


def _check(s: ServeSettings, where: str) -> ServeSettings:
  if any(c < 1 for c in s.concurrency) or any(not (math.isfinite(r) and r > 0) for r in s.rates):
    raise ConfigError(f"{where}: concurrency levels must be >= 1 and rates finite and > 0, got "
                      f"{list(s.concurrency)}, {list(s.rates)}")
  if not s.concurrency and not s.rates:
    raise ConfigError(f"{where}: give concurrency levels or rates")
  if any(n < 1 for n in s.buckets) or (s.client_processes is not None and s.client_processes < 0):
    raise ConfigError(f"{where}: buckets must be >= 1 and client_processes >= 0, got {list(s.buckets)}, "
                      f"{s.client_processes!r}")
  for key in ("num_prompts", "slots", "max_queue", "chunk", "rounds_per_call"):
    if getattr(s, key) < 1:
      raise ConfigError(f"{where}.{key}: must be >= 1, got {getattr(s, key)!r}")
  if s.call_ms is not None and not (isinstance(s.call_ms, (int, float)) and s.call_ms > 0):
    raise ConfigError(f"{where}.call_ms: must be > 0 ms, got {s.call_ms!r}")
  if s.prompts_per_client < 0:
    raise ConfigError(f"{where}.prompts_per_client: must be >= 0, got {s.prompts_per_client!r}")
  return s


def spec_from_dict(data, where: str = "config", methods: list[str] | None = None) -> BenchServeSpec:
  """A bench-serve config from its mapping; `methods` keeps only those method names (in their
  order in the config; an unknown name is an error that lists the config's)."""
  if not isinstance(data, dict):
    raise ConfigError(f"{where}: expected a mapping")
  data = dict(data)
  serve = _check(_build(ServeSettings, data.pop("serve", {}) or {}, f"{where}.serve"), f"{where}.serve")
  if methods is not None:
    known = [m.get("name") for m in data.get("methods") or [] if isinstance(m, dict)]
    unknown = [m for m in methods if m not in known]
    if unknown:
      raise ConfigError(f"{where}: no method(s) {unknown} in the config; it has {known}")
    data["methods"] = [m for m in data.get("methods") or [] if m.get("name") in methods]
  return BenchServeSpec(experiment=config_from_dict(data, where), serve=serve)


def load_bench_serve(path: str | Path, methods: list[str] | None = None) -> BenchServeSpec:
  from specjax.io.yaml_config import load_config
  path = Path(path)
  return spec_from_dict(load_config(path), where=path.name, methods=methods)
