"""`specjax serve` and `specjax bench-serve`, and `build_server`: a target + speculator -> a
ready `Server` (slot engine, scheduler, metrics), shared by the command, the benchmark and tests."""

from __future__ import annotations

import argparse
import json

from specjax.errors import UserError


def adaptive_config(adaptive):
  """`adaptive` as build_server takes it (False / None: off, True: the defaults, a dict of
  `AdaptiveConfig` fields, or an `AdaptiveConfig`) -> an AdaptiveConfig or None."""
  from specjax.engine.adaptive import AdaptiveConfig
  if not adaptive:
    return None
  if adaptive is True:
    return AdaptiveConfig()
  if isinstance(adaptive, dict):
    return AdaptiveConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in adaptive.items()})
  return adaptive


def build_server(target, speculator=None, *, slots: int = 8, capacity: int = 2048, max_queue: int = 64,
                 chunk: int = 256, n_max: int = 8, draft_model=None, head=None, options: dict | None = None,
                 rollback: str = "per_step", policy: str = "best", adaptive=False, rounds_per_call: int = 8,
                 buckets=None, call_ms: float | None = None):
  """A `Server` for `target` (a LoadedModel) with one speculator (None: plain decoding). `n_max`
  is the widest draft any request may ask for (requests pick theirs up to it). `adaptive` (True,
  a dict of `AdaptiveConfig` fields or an AdaptiveConfig) chooses before every round whether to
  speculate and how wide, from the live slots' acceptance and the rounds' measured cost
  (`specjax.serve.adaptive_slots`; tree drafters: the node budget, `adaptive_tree_slots`). `rounds_per_call`: the most rounds one
  device call runs while no request waits to join; `buckets`: the batch sizes the live slots are
  gathered into (None: `engine_adapter.default_buckets`); `call_ms`: a device call's time budget,
  which caps its rounds at what fits it (`Scheduler._rounds_in_budget`; None: no cap)."""
  from specjax.drafters.base import DraftParams
  from specjax.drafters.registry import make_speculator
  from specjax.serve.app import Server
  from specjax.serve.engine_adapter import SlotEngine
  from specjax.serve.metrics import ServeMetrics
  from specjax.serve.scheduler import Scheduler
  if call_ms is not None and not call_ms > 0:
    raise UserError(f"--call-ms must be > 0, got {call_ms}")
  if slots < 1 or capacity < 128 or max_queue < 1 or rounds_per_call < 1:
    raise UserError(f"--slots must be >= 1, --capacity >= 128, --max-queue >= 1 and --rounds-per-call >= 1, got "
                    f"{slots}, {capacity}, {max_queue}, {rounds_per_call}")
  if buckets is not None and any(int(n) < 1 for n in buckets):
    raise UserError(f"--buckets must be batch sizes >= 1, got {list(buckets)}")
  if getattr(target, "context_length", None) and capacity > target.context_length:
    raise UserError(f"--capacity {capacity} exceeds the model's context of {target.context_length} tokens")
  ac = adaptive_config(adaptive)
  if ac is not None and speculator is None:
    raise UserError("--adaptive chooses when to speculate: give a speculator (--spec)")
  make = None
  drafter = None
  if speculator is not None:
    dp = DraftParams(n_max=n_max)
    make = lambda: make_speculator(speculator, target, draft_model=draft_model, draft_params=dp, head=head,
                                   options=options, policy=policy)
    drafter = make()
    if ac is not None and drafter.proposes_tree and not drafter.on_device:
      raise UserError(f"--adaptive chooses a tree's node budget from its rounds on the device; {drafter.name} drafts "
                      f"on the host (leave --adaptive off)")
  stop_ids = tuple(target.tokenizer.eos_ids) if target.tokenizer is not None else ()
  engine = SlotEngine(target, drafter, slots=slots, capacity=capacity, chunk=chunk, stop_ids=stop_ids,
                      rollback=rollback, host_drafter_factory=make, adaptive=ac, buckets=buckets,
                      rounds_per_call=rounds_per_call)
  metrics = ServeMetrics(engine.max_draft)
  scheduler = Scheduler(engine, max_queue=max_queue, metrics=metrics, stop_ids=stop_ids, call_ms=call_ms)
  return Server(scheduler, target.tokenizer, vocab=target.cfg.vocab_size, capacity=capacity,
                model_name=getattr(target, "name", "model"), metrics=metrics)


def _server_args(p) -> None:
  p.add_argument("--model", default="smollm2-135m-instruct", help="fetch name, GGUF file or HF directory")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                 help="weights' dtype (default float32; with bench-serve --config, the config's)")
  p.add_argument("--draft-model", default=None, help="draft model for --spec draft")
  p.add_argument("--head", default=None, help="trained head for mtp, eagle3*, dflash*")
  p.add_argument("--spec-config", default=None, help="speculator options as JSON")
  p.add_argument("--n-max", type=int, default=8, help="widest draft a request may ask for (default 8)")
  p.add_argument("--slots", type=int, default=8, help="sequences generated together (default 8)")
  p.add_argument("--capacity", type=int, default=2048, help="KV cache tokens per slot: prompt + output (default 2048)")
  p.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429 (default 256)")
  p.add_argument("--chunk", type=int, default=256, help="prefill chunk, tokens (default 256)")
  p.add_argument("--rounds-per-call", type=int, default=8,
                 help="most rounds one device call runs while no request waits to join (default 8)")
  p.add_argument("--call-ms", type=float, default=None,
                 help="a device call's time budget in ms: its rounds are capped at what fits at the measured cost of "
                      "a round in its batch bucket, so a request arriving mid-call waits at most about this long to "
                      "join (default: no budget; raise --rounds-per-call with it)")
  p.add_argument("--buckets", type=_csv(int), default=None,
                 help="batch sizes the live slots run in, e.g. 1,8,64 (default 1, 8, 32, .. up to half the "
                      "slots, and every slot)")
  p.add_argument("--adaptive", action="store_true",
                 help="before every round choose whether to speculate and how wide, from the live slots' acceptance "
                      "and the rounds' measured cost (tree speculators: the node budget)")


def _load(args):
  from specjax import api
  from specjax.cli import _check_model_name, _spec_config
  _check_model_name(args.model, "--model")
  options = _spec_config(args.spec_config)
  return api.load(args.model, dtype=args.dtype or "float32"), options


def _server_from_args(args, target, options, spec):
  return build_server(target, spec, slots=args.slots, capacity=args.capacity, max_queue=args.max_queue,
                      chunk=args.chunk, n_max=args.n_max, draft_model=args.draft_model, head=args.head,
                      options=options, adaptive=args.adaptive, rounds_per_call=args.rounds_per_call,
                      buckets=args.buckets, call_ms=args.call_ms)


def cmd_serve(args) -> int:
  import uvicorn
  target, options = _load(args)
  server = _server_from_args(args, target, options, args.spec)
  server.scheduler.warm()
  print(f"serving {target.name} ({args.spec or 'plain'}, {args.slots} slots) on http://{args.host}:{args.port}")
  uvicorn.run(server.app(), host=args.host, port=args.port, log_level="warning")
  return 0


def _csv(kind):
  def parse(s):
    try:
      return [kind(x) for x in s.split(",") if x.strip()]
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {s!r}")
  return parse


def cmd_bench_serve(args) -> int:
  """From a config (`--config`: methods with their heads, options and draft parameters, and the
  `serve:` section), or from flags (plain decoding, then each `--spec` with the shared server flags)."""
  from specjax.bench.config import DraftParamsConfig, MethodConfig
  from specjax.serve.bench_serve import BenchServeConfig, run_bench
  if args.config:
    return _bench_serve_config(args)
  if not args.concurrency and not args.rate:
    args.concurrency = [1, 8, 32, 64]
  specs = [MethodConfig(name=s, speculator=s, draft_model=args.draft_model, head=args.head,
                        draft_params=DraftParamsConfig(n_max=args.n_max), adaptive=args.adaptive)
           for s in args.spec or []]
  cfg = BenchServeConfig(methods=specs if args.no_plain else [None] + specs, concurrency=args.concurrency or [],
                         rates=args.rate or [], num_prompts=args.num_prompts or 64,
                         prompts_per_client=args.prompts_per_client, max_tokens=args.max_tokens or 128,
                         dataset=args.dataset, url=args.url, out=args.out or "experiments/results/bench_serve",
                         seed=args.seed, temperature=args.temperature, warmup=not args.no_warmup,
                         client_processes=args.client_processes,
                         server={"model": args.model, "dtype": args.dtype or "float32", "slots": args.slots,
                                 "capacity": args.capacity, "chunk": args.chunk, "max_queue": args.max_queue,
                                 "spec_config": args.spec_config, "rounds_per_call": args.rounds_per_call,
                                 "buckets": args.buckets, "call_ms": args.call_ms})
  if not cfg.methods:
    raise UserError("nothing to measure: --no-plain needs at least one --spec")
  target, options = (None, None) if args.url else _load(args)

  def make(method):
    return build_server(target, None if method is None else method.speculator, slots=args.slots,
                        capacity=args.capacity, max_queue=args.max_queue, chunk=args.chunk, n_max=args.n_max,
                        draft_model=args.draft_model, head=args.head, options=options, adaptive=args.adaptive,
                        rounds_per_call=args.rounds_per_call, buckets=args.buckets, call_ms=args.call_ms)
  result = run_bench(cfg, make)
  print(json.dumps(result["summary"], indent=1))
  return 0


def _bench_serve_config(args) -> int:
  """bench-serve from a config file; --methods keeps some of its methods, and the load flags given
  (--concurrency, --rate, --num-prompts, --prompts-per-client, --max-tokens, --client-processes,
  --out) and --dtype override it."""
  import dataclasses

  from specjax import api
  from specjax.serve.bench_config import load_bench_serve
  from specjax.serve.bench_serve import BenchServeConfig, run_bench
  spec = load_bench_serve(args.config, methods=args.methods)
  exp, sv = spec.experiment, spec.serve
  dtype = args.dtype or exp.dtype
  if args.concurrency or args.rate:
    sv = dataclasses.replace(sv, concurrency=tuple(args.concurrency or ()), rates=tuple(args.rate or ()))
  methods = ([None] if sv.plain and not args.no_plain else []) + list(exp.methods)
  if not methods:
    raise UserError("nothing to measure: the config has no methods and plain decoding is off")
  capacity = exp.capacity or 2048
  cfg = BenchServeConfig(methods=methods, concurrency=list(sv.concurrency), rates=list(sv.rates),
                         num_prompts=args.num_prompts or sv.num_prompts,
                         prompts_per_client=args.prompts_per_client or sv.prompts_per_client,
                         max_tokens=args.max_tokens or exp.max_new_tokens, dataset=exp.prompts[0], url=args.url,
                         out=args.out or f"experiments/results/{exp.name}", seed=exp.seed,
                         temperature=exp.sampling.temperature, warmup=not args.no_warmup,
                         client_processes=sv.client_processes if args.client_processes is None else args.client_processes,
                         server={"name": exp.name, "model": exp.target, "dtype": dtype, "slots": sv.slots,
                                 "capacity": capacity, "chunk": sv.chunk, "max_queue": sv.max_queue,
                                 "rounds_per_call": sv.rounds_per_call, "buckets": list(sv.buckets) or None,
                                 "call_ms": sv.call_ms})
  target = None if args.url else api.load(exp.target, dtype=dtype)

  shared = dict(slots=sv.slots, capacity=capacity, max_queue=sv.max_queue, chunk=sv.chunk,
                rounds_per_call=sv.rounds_per_call, buckets=sv.buckets or None, call_ms=sv.call_ms)

  def make(m):
    if m is None:
      return build_server(target, None, **shared)
    return build_server(target, m.speculator, n_max=m.draft_params.n_max, draft_model=m.draft_model, head=m.head,
                        options=m.options or None, policy=m.policy, adaptive=m.adaptive, **shared)
  result = run_bench(cfg, make)
  print(json.dumps(result["summary"], indent=1))
  return 0


def add_serve_commands(sub) -> None:
  s = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching and speculative slots")
  _server_args(s)
  s.add_argument("--spec", default=None, help="speculator (or chain); requests may turn it off or narrow it")
  s.add_argument("--host", default="127.0.0.1")
  s.add_argument("--port", type=int, default=8000)
  s.set_defaults(func=cmd_serve)

  b = sub.add_parser("bench-serve", help="load-test a server: TTFT, TPOT, throughput and tau per concurrency level")
  _server_args(b)
  b.add_argument("--config", default=None,
                 help="a bench-serve config (specjax/serve/bench_config.py): target, methods and a serve: section; "
                      "the model, speculator and server flags are then the config's")
  b.add_argument("--methods", type=_csv(str), default=None, help="with --config: keep only these methods (names)")
  b.add_argument("--spec", action="append", default=None,
                 help="a speculator to compare with plain decoding (repeatable; each gets its own server)")
  b.add_argument("--no-plain", action="store_true", help="skip the plain-decoding server")
  b.add_argument("--concurrency", type=_csv(int), default=None, help="fixed concurrency levels (default 1,8,32,64)")
  b.add_argument("--rate", type=_csv(float), default=None, help="Poisson arrival rates, requests/s")
  b.add_argument("--num-prompts", type=int, default=None, help="requests per level, at least (default 64)")
  b.add_argument("--prompts-per-client", type=int, default=0,
                 help="and at least this many per client at a concurrency level (default 0)")
  b.add_argument("--no-warmup", action="store_true", help="skip the untimed requests that compile before timing")
  b.add_argument("--client-processes", type=int, default=None,
                 help="processes the clients of a level run in (default one per 8 clients, up to half the cores; 0: the "
                      "benchmark's own process, which shares the in-process server's interpreter lock)")
  b.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 128)")
  b.add_argument("--temperature", type=float, default=0.0)
  b.add_argument("--dataset", default="mt_bench", help="prompt set (specjax.io.datasets; default mt_bench)")
  b.add_argument("--url", default=None, help="measure a running server instead of starting one")
  b.add_argument("--seed", type=int, default=0)
  b.add_argument("--out", default=None,
                 help="output prefix: .json and .png (default experiments/results/bench_serve, or the config's name)")
  b.set_defaults(func=cmd_bench_serve)
