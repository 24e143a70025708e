"""`specjax bench-serve`: what speculation does under load.

For each method (plain decoding, then each speculator), a server is started in-process (or a
given URL is used) and driven by streamed chat requests with MT-bench prompts, either at fixed
concurrency (N clients, each sending its next request when the last one ends) or as a Poisson
process at given rates. The clients run in processes of their own (one per 8 clients, up to half
the cores; `--client-processes`), so that parsing the streams does not compete with the server
for its process's interpreter lock. Before anything is timed, the server compiles its programs
(`warm`) and every distinct prompt of the run is sent once (max_tokens 2). Per level it reports
time to first token, time per output token (after the first), output throughput, tau (tokens per
slot-round, from each response's usage), and from /metrics the rounds the server ran at each
verification width and in each batch bucket and its device calls, as JSON beside a PNG of
throughput against concurrency (or rate); both are rewritten after every level, so a run cut by
a time limit keeps what it finished. The JSON records the git revision, the device and the config.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import os
import random
import re
import sys
import time
from pathlib import Path

import numpy as np

WARMUP_TOKENS = 2      # max_tokens of the untimed requests that compile prefill widths and a round


@dataclasses.dataclass
class BenchServeConfig:
  methods: list                  # None = plain decoding; else a `MethodConfig` (or a speculator name)
  concurrency: list[int]
  rates: list[float]
  num_prompts: int = 64          # requests per level, at least
  prompts_per_client: int = 0    # and at least this many per client at a concurrency level
  max_tokens: int = 128
  dataset: str = "mt_bench"
  url: str | None = None
  out: str = "experiments/results/bench_serve"
  seed: int = 0
  temperature: float = 0.0
  warmup: bool = True            # untimed requests first (every distinct prompt once)
  server: dict = dataclasses.field(default_factory=dict)   # what the servers were built with (recorded)
  client_processes: int | None = None   # processes the clients of a level run in (None: one per
                                        # 8 clients, up to half the cores; 0: this process)

  def requests_at(self, kind: str, level) -> int:
    return max(self.num_prompts, self.prompts_per_client * int(level) if kind == "concurrency" else 0)

  def processes_at(self, kind: str, level) -> int:
    """Client processes of a level (0: the clients share the benchmark's process, and with an
    in-process server its interpreter lock)."""
    if self.client_processes is not None:
      return min(self.client_processes, int(level)) if kind == "concurrency" else self.client_processes
    most = max(1, min(8, (os.cpu_count() or 2) // 2))
    return min(most, -(-int(level) // 8)) if kind == "concurrency" else most


@dataclasses.dataclass
class Sample:
  """One request as the client saw it."""
  ok: bool
  ttft: float = 0.0             # s from sending to the first token
  latency: float = 0.0          # s from sending to the last byte
  n_out: int = 0
  rounds: int = 0


def method_name(method) -> str:
  return "plain" if method is None else getattr(method, "name", str(method))


def request_fields(method) -> dict:
  """What a method sets in each request: its n_min / p_min as the `speculative` field."""
  dp = getattr(method, "draft_params", None)
  spec = {k: getattr(dp, k) for k in ("n_min", "p_min") if dp is not None and getattr(dp, k)}
  return {"speculative": spec} if spec else {}


def prompts_of(dataset: str, n: int, seed: int) -> list[str]:
  """n first-turn prompts of the set (cycled when it has fewer), in a seeded order."""
  from specjax.bench.prompts import load_prompt_set
  turns = [q.turns[0] for q in load_prompt_set(dataset)]
  random.Random(seed).shuffle(turns)
  return [turns[i % len(turns)] for i in range(n)]


async def _request(client, prompt: str, cfg: BenchServeConfig, fields: dict, max_tokens: int | None = None) -> Sample:
  """One streamed chat completion (`fields`: the method's `request_fields`); tokens counted by
  their ids, tau from the final usage."""
  body = {"model": "bench", "messages": [{"role": "user", "content": prompt}],
          "max_tokens": max_tokens or cfg.max_tokens, "temperature": cfg.temperature, "seed": cfg.seed,
          "stream": True, "stream_options": {"include_usage": True}, **fields}
  t0 = time.perf_counter()
  s = Sample(ok=False)
  async with client.stream("POST", "/v1/chat/completions", json=body) as r:
    if r.status_code != 200:
      await r.aread()
      return s
    async for line in r.aiter_lines():
      if not line.startswith("data: {"):
        continue
      ev = json.loads(line[6:])
      for c in ev.get("choices", []):
        n = len(c.get("token_ids") or [])
        if n and not s.n_out:
          s.ttft = time.perf_counter() - t0
        s.n_out += n
      if ev.get("usage"):
        s.rounds = ev["usage"].get("speculative", {}).get("rounds", 0)
  s.latency, s.ok = time.perf_counter() - t0, s.n_out > 0
  return s


async def _fixed(client, prompts, cfg, fields, level: int, bar=None) -> list[Sample]:
  """`level` clients, each sending its next prompt when its last request ends."""
  queue = list(prompts)
  out: list[Sample] = []

  async def worker():
    while queue:
      out.append(await _request(client, queue.pop(), cfg, fields))
      if bar is not None:
        bar.update(1)
  await asyncio.gather(*(worker() for _ in range(level)))
  return out


async def _poisson(client, prompts, cfg, fields, rate: float, bar=None, share: int | None = None) -> list[Sample]:
  """Requests sent at exponential inter-arrival times of mean 1/rate (`share`: which client
  process's part of the arrivals, each drawn from its own seed)."""
  rng = np.random.default_rng(cfg.seed if share is None else (cfg.seed, share))
  tasks = []

  async def one(p):
    s = await _request(client, p, cfg, fields)
    if bar is not None:
      bar.update(1)
    return s
  for p in prompts:
    tasks.append(asyncio.create_task(one(p)))
    await asyncio.sleep(float(rng.exponential(1.0 / rate)))
  return list(await asyncio.gather(*tasks))


def summarize(samples: list[Sample], wall: float) -> dict:
  ok = [s for s in samples if s.ok]
  tpot = [(s.latency - s.ttft) / (s.n_out - 1) for s in ok if s.n_out > 1]
  n_out = sum(s.n_out for s in ok)
  rounds = sum(s.rounds for s in ok)
  pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None
  return {"requests": len(samples), "ok": len(ok), "output_tokens": n_out, "seconds": round(wall, 3),
          "throughput_tok_s": n_out / wall if wall > 0 else 0.0,
          "ttft_s": {"mean": float(np.mean([s.ttft for s in ok])) if ok else None,
                     "p50": pct([s.ttft for s in ok], 50), "p99": pct([s.ttft for s in ok], 99)},
          "tpot_s": {"mean": float(np.mean(tpot)) if tpot else None, "p50": pct(tpot, 50), "p99": pct(tpot, 99)},
          "tau": (n_out - len(ok)) / rounds if rounds else None}     # the prefill's token is not a round's


_COUNT_LINE = re.compile(r'^specjax_(rounds_at_width|rounds_at_batch|device_calls|prefill_calls|prefill_rows|compiles|'
                         r'compile_seconds|model_thread_seconds|step_seconds)_total(?:\{\w+="(\w+)"\})? (\S+)$', re.M)
_COUNT_NAMES = {"rounds_at_width": "rounds_by_width", "rounds_at_batch": "rounds_by_batch", "device_calls": "device_calls",
                "prefill_calls": "prefill_calls", "prefill_rows": "prefill_rows",
                "compiles": "compiles", "compile_seconds": "compile_s", "model_thread_seconds": "model_thread_s",
                "step_seconds": "step_s"}
_SECONDS = ("compile_seconds", "model_thread_seconds", "step_seconds")


_ADAPTIVE_LINE = re.compile(r'^specjax_adaptive_(round_ms|tau|calls_cut)\{(.*?)\} (\S+)$', re.M)


def adaptive_state(text: str) -> dict:
  """The adaptive controller's gauges in a /metrics text: {"round_ms": {bucket: {width: ms}},
  "tau": {width: tokens per round}, "calls_cut": {rule: calls since the server started}} ({} without
  an adaptive controller)."""
  out: dict = {}
  for name, labels, value in _ADAPTIVE_LINE.findall(text):
    lab = dict(re.findall(r'(\w+)="(\w+)"', labels))
    if name == "round_ms":
      out.setdefault("round_ms", {}).setdefault(lab["bucket"], {})[lab["width"]] = round(float(value), 4)
    elif name == "calls_cut":
      out.setdefault("calls_cut", {})[lab["rule"]] = int(float(value))
    else:
      out.setdefault("tau", {})[lab["width"]] = round(float(value), 4)
  return out


async def server_counts(client) -> dict[str, dict[str, float]]:
  """The server's rounds so far at each verification width ("rounds_by_width") and in each batch
  bucket ("rounds_by_batch"), its device calls ("device_calls": {"": n}), its prefill calls and the
  prompt pieces they took ("prefill_calls", "prefill_rows"), XLA compilations
  ("compiles", "compile_s": their seconds) and its model thread's seconds by part ("model_thread_s":
  rounds, prefill, host), the calls of rounds' seconds by part ("step_s": call, fetch, observe, step;
  `SlotEngine.take_step_seconds`), and an adaptive controller's state ("adaptive", `adaptive_state`), from its
  /metrics ({} without them)."""
  r = await client.get("/metrics")
  out: dict[str, dict[str, float]] = {}
  for name, label, n in (_COUNT_LINE.findall(r.text) if r.status_code == 200 else []):
    out.setdefault(_COUNT_NAMES[name], {})[label] = float(n) if name in _SECONDS else int(float(n))
  if r.status_code == 200 and (state := adaptive_state(r.text)):
    out["adaptive"] = state
  return out


START_S = 0.5          # client processes start a level this long after it is handed to them


def _client_ready(_) -> int:
  import httpx  # noqa: F401  (imported before anything is timed)
  time.sleep(0.2)
  return os.getpid()


def client_pool(processes: int):
  """`processes` client processes (spawned: the benchmark's process may hold a device), each with
  its imports done; None for 0."""
  if processes < 1:
    return None
  pool = multiprocessing.get_context("spawn").Pool(processes)
  for _ in range(10):
    if len(set(pool.map(_client_ready, range(2 * processes), chunksize=1))) == processes:
      break
  return pool


def _client_share(url: str, cfg: BenchServeConfig, fields: dict, kind: str, level, prompts: list[str],
                  share: int, start_at: float) -> tuple[list[Sample], float]:
  """One client process's part of a level, sent from wall-clock time `start_at` on.
  -> (its samples, wall-clock time it ended)."""
  import httpx

  async def main():
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=1024)) as client:
      await asyncio.sleep(max(0.0, start_at - time.time()))
      if kind == "concurrency":
        return await _fixed(client, prompts, cfg, fields, level)
      return await _poisson(client, prompts, cfg, fields, level, share=share)
  samples = asyncio.run(main())
  return samples, time.time()


def shares(prompts: list[str], kind: str, level, processes: int) -> list[tuple]:
  """A level split over `processes` client processes -> [(the process's level, its prompts)]: at
  fixed concurrency the clients are dealt out evenly and client c sends prompts c, c + level, ...;
  a Poisson rate is split evenly, each process sending every processes-th prompt."""
  if kind != "concurrency":
    return [(level / processes, prompts[p::processes]) for p in range(processes)]
  out = []
  for p in range(processes):
    clients = range(p, level, processes)
    out.append((len(clients), [prompts[i] for c in clients for i in range(c, len(prompts), level)]))
  return out


async def _level_in_processes(pool, url: str, cfg: BenchServeConfig, fields: dict, kind: str, level,
                              prompts: list[str]) -> tuple[list[Sample], float]:
  """A level run by client processes -> (samples, wall seconds from its start to the last answer)."""
  start_at = time.time() + START_S
  light = dataclasses.replace(cfg, methods=[])
  jobs = [pool.apply_async(_client_share, (url, light, fields, kind, lvl, part, i, start_at))
          for i, (lvl, part) in enumerate(shares(prompts, kind, level, cfg.processes_at(kind, level))) if part]
  results = await asyncio.to_thread(lambda: [j.get() for j in jobs])
  return [s for samples, _ in results for s in samples], max(end for _, end in results) - start_at


async def _measure(url: str, cfg: BenchServeConfig, method, on_row, pool=None) -> list[dict]:
  """Every level against one server: the untimed warm-up, then each level (in the client
  processes of `pool` where `cfg.processes_at` says so); `on_row(row)` after each."""
  import httpx
  from tqdm import tqdm
  rows = []
  fields = request_fields(method)
  levels = [("concurrency", c) for c in cfg.concurrency] + [("rate", r) for r in cfg.rates]
  async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=1024)) as client:
    if cfg.warmup:
      longest = max(cfg.requests_at(kind, level) for kind, level in levels)
      distinct = list(dict.fromkeys(prompts_of(cfg.dataset, longest, cfg.seed)))
      limit = asyncio.Semaphore(max(cfg.concurrency or [8]))
      async def warm(p):
        async with limit:
          return await _request(client, p, cfg, fields, max_tokens=WARMUP_TOKENS)
      t0 = time.perf_counter()
      await asyncio.gather(*(warm(p) for p in distinct))
      print(f"[bench-serve] {method_name(method)}: {len(distinct)} distinct prompts sent once in "
            f"{time.perf_counter() - t0:.1f} s (untimed)", file=sys.stderr, flush=True)
    for kind, level in levels:
      prompts = prompts_of(cfg.dataset, cfg.requests_at(kind, level), cfg.seed)
      before = await server_counts(client)
      processes = cfg.processes_at(kind, level) if pool is not None else 0
      if processes:
        samples, wall = await _level_in_processes(pool, url, cfg, fields, kind, level, prompts)
      else:
        with tqdm(total=len(prompts), desc=f"{method_name(method)} {kind}={level}", leave=False) as bar:
          t0 = time.perf_counter()
          run = _fixed if kind == "concurrency" else _poisson
          samples = await run(client, prompts, cfg, fields, level, bar)
          wall = time.perf_counter() - t0
      row = {"method": method_name(method), kind: level, "client_processes": processes, **summarize(samples, wall)}
      after = await server_counts(client)
      adaptive = after.pop("adaptive", None)         # gauges: the controller's state at the level's end
      before.pop("adaptive", None)
      for key, counts in after.items():
        then = before.get(key, {})
        row[key] = {k: n - then.get(k, 0) for k, n in counts.items() if n - then.get(k, 0)}
      for key in ("device_calls", "prefill_calls", "prefill_rows", "compiles", "compile_s"):   # unlabelled: one number each
        row[key] = row.get(key, {}).get("", 0)
      row["compile_s"] = round(row["compile_s"], 3)
      row["model_thread_s"] = {k: round(v, 3) for k, v in row.get("model_thread_s", {}).items()}
      row["step_s"] = {k: round(v, 3) for k, v in row.get("step_s", {}).items()}
      if adaptive:
        row["adaptive"] = adaptive
      rows.append(row)
      on_row(row)
  return rows


def _config_record(cfg: BenchServeConfig) -> dict:
  d = dataclasses.asdict(cfg)
  d["methods"] = [m if m is None or isinstance(m, str) else dataclasses.asdict(m) for m in cfg.methods]
  return d


def run_bench(cfg: BenchServeConfig, make_server) -> dict:
  """Measure each method (a fresh in-process server per method, or `cfg.url`) with clients in
  their own processes (`cfg.processes_at`), so that parsing the streams does not take the server
  process's interpreter lock; JSON + PNG are written after every level."""
  from specjax.bench.env import device_info, environment, git_revision
  from specjax.serve.app import run_in_thread
  rows: list[dict] = []
  out = Path(cfg.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  result = {"config": _config_record(cfg), "git_rev": git_revision(), "device": device_info(),
            "environment": environment(), "rows": rows, "summary": [], "warm_up": {}}

  def write(row=None):
    if row is not None:
      rows.append(row)
    result["summary"] = [{k: r.get(k) for k in ("method", "concurrency", "rate", "throughput_tok_s", "tau")}
                         for r in rows]
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    if rows:
      plot(rows, out.with_suffix(".png"))

  write()
  levels = [("concurrency", c) for c in cfg.concurrency] + [("rate", r) for r in cfg.rates]
  pool = client_pool(max([cfg.processes_at(kind, level) for kind, level in levels], default=0))
  try:
    for method in ([None] if cfg.url else cfg.methods):
      if cfg.url:
        asyncio.run(_measure(cfg.url, cfg, "url", write, pool))
        continue
      t0 = time.perf_counter()
      server = make_server(method)
      t1 = time.perf_counter()
      server.scheduler.warm()        # prefill programs and every bucket's rounds compiled before anything is timed
      phases = getattr(server.scheduler.engine, "warm_phases", None) or {}
      result["warm_up"][method_name(method)] = {"build_s": round(t1 - t0, 2), **phases}
      print(f"[bench-serve] {method_name(method)}: server built in {t1 - t0:.1f} s, warm-up compiled in "
            f"{time.perf_counter() - t1:.1f} s {phases}", file=sys.stderr, flush=True)
      http, url = run_in_thread(server.app())
      try:
        asyncio.run(_measure(url, cfg, method, write, pool))
      finally:
        http.should_exit = True
        server.scheduler.stop()
  finally:
    if pool is not None:
      pool.terminate()
  return result


def plot(rows: list[dict], path: Path) -> None:
  """Throughput against concurrency (and against rate), one line per method."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  kinds = [k for k in ("concurrency", "rate") if any(k in r for r in rows)]
  fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4), squeeze=False)
  for ax, kind in zip(axes[0], kinds):
    for method in dict.fromkeys(r["method"] for r in rows):
      pts = sorted((r[kind], r["throughput_tok_s"]) for r in rows if r["method"] == method and kind in r)
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    ax.set_xlabel(kind + (" (requests/s)" if kind == "rate" else " (clients)"))
    ax.set_ylabel("output tokens/s")
    if kind == "concurrency":
      ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=90)
  plt.close(fig)
