"""Bitwise losslessness in bf16 with the batch-invariant forward, and what it costs.

For each mode ("default": the XLA forward; "invariant": the batch-invariant kernels,
`ModelConfig.invariant`) and each method (`METHODS`: plain greedy decoding, every built-in
speculator, the head speculators with the heads in assets/smollm2/, and a chain), MT-bench first
turns are generated one at a time (batch 1, greedy, 128 new tokens, stop at EOS). A method's
output on a prompt is `equal` when it is, token for token, the plain output of the same mode.
Every run is timed after an untimed run of the same prompt (compilation, warm-up): tokens/s of a
mode and method = tokens / seconds over its prompts, and invariant / default is the cost of the
mode (not a speed for drafters that learn across requests, which the untimed run teaches).

A self-check comes first, in both modes: the logits of a prompt's continuation decoded one token at
a time, against the same positions verified as one chain and inside a tree whose other branches
hold other tokens (`bitwise` per comparison, and the largest difference).

  OUT=/tmp/o bash experiments/gpu/invariant.sh                  # on the GPU machine
  python experiments/invariant_equality.py --out /tmp/r.json --limit 2 --new-tokens 16   # anywhere

--processes N splits the methods over N processes at once (plain and the self-check in the first),
each with 1/N of the device memory, and merges their files into --out (`--merge FILE...` does that
alone): a run is mostly compilation, which a process does on one host core, so N processes compile
N methods at a time. Their tok/s then share the device: equality is what such a run is for.

The JSON (with the git revision, the device and the versions) is rewritten after every prompt, so a
run cut short keeps what it finished; --resume continues it. --budget stops starting new prompts
after that many seconds. Compiled programs are kept on disk as by the CLI (SPECJAX_COMPILE_CACHE=0:
off).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from specjax import api  # noqa: E402
from specjax.bench.env import device_info, git_revision, versions  # noqa: E402
from specjax.bench.prompts import load_prompt_set  # noqa: E402
from specjax.drafters.base import DraftParams  # noqa: E402
from specjax.drafters import speculator_spec  # noqa: E402
from specjax.drafters.registry import make_speculator  # noqa: E402
from specjax.io import compile_cache  # noqa: E402
from specjax.models.decoder import forward  # noqa: E402
from specjax.models.kv_cache import KVCache  # noqa: E402

HEADS = ROOT / "assets" / "smollm2"
NGRAM_DP = {"n_max": 8, "n_min": 1}
# name -> (speculator, head, draft params, options): every built-in speculator and a chain of two.
# `draft` / `draft_tree` draft with a copy of the target whose matrices carry 30 % noise (the
# registry's example draft model; SmolLM2 has no smaller sibling with its tokenizer): whether the
# output equals plain decoding depends on how the target verifies, not on where drafts come from.
METHODS = {
    "plain": None,
    "ngram_simple": ("ngram_simple", None, NGRAM_DP, {"size_n": 3, "size_m": 16}),
    "mtp": ("mtp", HEADS / "mtp" / "mtp_head.safetensors", {"n_max": 3}, None),
    "eagle3_tree": ("eagle3_tree", HEADS / "eagle3" / "eagle3_head.safetensors", {}, {"n_nodes": 48}),
    "dflash_tree": ("dflash_tree", HEADS / "dflash" / "dflash.safetensors", {}, {"n_nodes": 32}),
    "eagle3": ("eagle3", HEADS / "eagle3" / "eagle3_head.safetensors", {"n_max": 5}, None),
    "dflash": ("dflash", HEADS / "dflash" / "dflash.safetensors", {}, None),
    "draft": ("draft", None, {"n_max": 4}, None),
    "draft_tree": ("draft_tree", None, {}, {"depth": 4, "top_k": 2, "n_nodes": 12}),
    "ngram_map_k": ("ngram_map_k", None, NGRAM_DP, {"size_n": 3, "size_m": 16}),
    "ngram_map_k4v": ("ngram_map_k4v", None, NGRAM_DP, {"size_n": 3, "size_m": 16}),
    "ngram_mod": ("ngram_mod", None, {}, {"n_match": 4, "n_min": 2, "n_max": 16}),
    "ngram_cache": ("ngram_cache", None, {}, None),
    "suffix": ("suffix", None, NGRAM_DP, None),
    "ngram_simple,suffix": ("ngram_simple,suffix", None, NGRAM_DP, {"ngram_simple": {"size_n": 3, "size_m": 16}}),
}
DRAFT_MODEL_METHODS = ("draft", "draft_tree")
# rough seconds a method's first prompt takes on an H200 (compilation and warm-up), for --processes
FIRST_PROMPT_S = {"draft": 110, "draft_tree": 105, "suffix": 75, "eagle3": 40, "dflash": 38, "eagle3_tree": 45,
                  "dflash_tree": 40, "mtp": 35, "plain": 30}
MODES = ("invariant", "default")
CHECK_LEN = 8                         # continuation tokens compared in the self-check


# ----------------------------------------------------------------------------------------------
# self-check: a position's logits alone, in a chain, in a tree


def self_check(target, prompt: list[int], capacity: int) -> dict:
  """Decode CHECK_LEN greedy tokens one at a time after `prompt`, then verify the same positions
  as one chain and as the spine of a tree (each spine node past the root has a leaf sibling
  holding another token); compare each position's logits with the one-token decode's."""
  cfg, params = target.cfg, target.params
  fwd = jax.jit(lambda p, x, c, pos, m: forward(p, cfg, x, c, positions=pos, attn_mask=m))
  chain_fwd = jax.jit(lambda p, x, c: forward(p, cfg, x, c))
  dtype = jax.tree_util.tree_leaves(params)[0].dtype
  tokens = jnp.asarray([prompt], jnp.int32)
  logits, _, cache = chain_fwd(params, tokens, KVCache.init(cfg, 1, capacity, dtype=dtype))
  last = int(jnp.argmax(logits[0, -1]))
  path, decoded, c = [last], [], cache
  for _ in range(CHECK_LEN):
    lg, _, c = chain_fwd(params, jnp.asarray([[path[-1]]], jnp.int32), c)
    decoded.append(lg[0, 0])
    path.append(int(jnp.argmax(lg[0, 0])))
  spine = path[:CHECK_LEN]                                                       # [last, d1..d7]
  chain, _, _ = chain_fwd(params, jnp.asarray([spine], jnp.int32), cache)
  # tree: the spine, and beside each spine node past the root a leaf sibling holding another token
  parents, tree_tokens, spine_node = [-1], [spine[0]], [0]
  for i in range(1, CHECK_LEN):
    for token in (spine[i], (spine[i] + 1) % cfg.vocab_size):
      parents.append(spine_node[i - 1])
      tree_tokens.append(token)
    spine_node.append(len(parents) - 2)
  t = len(parents)
  depth, anc = np.zeros(t, np.int32), np.zeros((t, t), bool)
  for u in range(t):
    anc[u, u] = True
    if parents[u] >= 0:
      anc[u] |= anc[parents[u]]
      depth[u] = depth[parents[u]] + 1
  tree, _, _ = fwd(params, jnp.asarray([tree_tokens], jnp.int32), cache,
                   cache.lengths[:, None] + jnp.asarray(depth)[None, :], jnp.asarray(anc)[None])
  rows = []
  for i in range(CHECK_LEN):
    want = np.asarray(decoded[i])
    got_c, got_t = np.asarray(chain[0, i]), np.asarray(tree[0, spine_node[i]])
    rows.append({"position": i, "chain_bitwise": bool(np.array_equal(got_c, want)),
                 "chain_max_abs": float(np.max(np.abs(got_c - want))),
                 "tree_bitwise": bool(np.array_equal(got_t, want)),
                 "tree_max_abs": float(np.max(np.abs(got_t - want))),
                 "argmax_equal": bool(np.argmax(got_c) == np.argmax(want) == np.argmax(got_t))})
  return {"prompt_tokens": len(prompt), "rows": rows,
          "all_bitwise": all(r["chain_bitwise"] and r["tree_bitwise"] for r in rows)}


# ----------------------------------------------------------------------------------------------
# the equality runs


def perturbed_draft_model(target):
  """The registry's example draft model for `target`: its weights with 30 % noise (seeded)."""
  return speculator_spec.get("draft").example(target, None)["draft_model"]


def build_drafters(target, methods) -> dict:
  """The named methods' speculators (only these: a head the run does not use need not be here)."""
  out = {}
  for name in methods:
    spec = METHODS[name]
    if spec is None:
      continue
    speculator, head, dp, options = spec
    dparams = DraftParams(**dp)
    draft_model = perturbed_draft_model(target) if name in DRAFT_MODEL_METHODS else None
    out[name] = (make_speculator(speculator, target, draft_params=dparams, options=options, draft_model=draft_model,
                                 head=None if head is None else str(head)), dp)
  return out


def run_once(target, prompt: list[int], drafter, dp, new_tokens: int, capacity: int):
  """(tokens, seconds) of one greedy generation, stopped at EOS (an untimed run first)."""
  kw = dict(max_new_tokens=new_tokens, sampling={"temperature": 0.0}, chat=False, capacity=capacity)
  if drafter is not None:
    kw.update(speculator=drafter, draft_params=dp)
  api.generate(target, [prompt], **kw)
  out = api.generate(target, [prompt], **kw)
  return out.tokens[0], out.seconds


def summarize(result: dict) -> None:
  """tokens/s and equality per mode and method, and the invariant / default cost."""
  summary = {}
  for mode, per_method in result["runs"].items():
    plain = per_method.get("plain", {})
    for name, rows in per_method.items():
      for key, r in rows.items():          # plain may have run after a method (a resumed run)
        if name != "plain" and key in plain:
          r["equal"] = r["tokens"] == plain[key]["tokens"]
      done = [r for r in rows.values()]
      if not done:
        continue
      toks, secs = sum(r["n_tokens"] for r in done), sum(r["seconds"] for r in done)
      eq = [r["equal"] for r in done if r["equal"] is not None]
      summary.setdefault(mode, {})[name] = {
          "prompts": len(done), "tokens_per_s": toks / max(secs, 1e-9),
          "equal": (sum(eq) / len(eq)) if eq else None, "n_equal": sum(eq), "n_compared": len(eq)}
  cost = {}
  for name in METHODS:
    d, i = summary.get("default", {}).get(name), summary.get("invariant", {}).get(name)
    if d and i:
      cost[name] = {"invariant_over_default_tokens_per_s": i["tokens_per_s"] / d["tokens_per_s"]}
  result["summary"], result["cost"] = summary, cost


def write(result: dict, path: Path) -> None:
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(result, indent=1))
  os.replace(tmp, path)


def split_methods(methods: list[str], n: int) -> list[list[str]]:
  """`methods` in n groups of about equal first-prompt time, plain in the first (greedy: the
  slowest method to the lightest group)."""
  groups: list[list[str]] = [[] for _ in range(min(n, len(methods)))]
  load = [0.0] * len(groups)
  rest = sorted((m for m in methods if m != "plain"), key=lambda m: -FIRST_PROMPT_S.get(m, 28))
  if "plain" in methods:
    groups[0].append("plain")
    load[0] += FIRST_PROMPT_S["plain"]
  for m in rest:
    i = min(range(len(groups)), key=load.__getitem__)
    groups[i].append(m)
    load[i] += FIRST_PROMPT_S.get(m, 28)
  return [g for g in groups if g]


def merge(paths: list[Path], out: Path) -> dict:
  """The union of several result files' runs (the first file's other fields), summarized."""
  results = [json.loads(p.read_text()) for p in paths if p.is_file()]
  if not results:
    raise SystemExit(f"nothing to merge: none of {[str(p) for p in paths]} exists")
  merged = results[0]
  for r in results[1:]:
    for mode, per_method in r.get("runs", {}).items():
      for name, rows in per_method.items():
        merged["runs"].setdefault(mode, {}).setdefault(name, {}).update(rows)
    for mode, check in r.get("self_check", {}).items():
      merged.setdefault("self_check", {}).setdefault(mode, check)
  modes = list(merged["runs"])
  methods = sorted({n for r in results for n in r["config"]["methods"]}       # with a resumed file's methods
                   | {n for per in merged["runs"].values() for n in per}, key=list(METHODS).index)
  keys = set().union(*(rows for per in merged["runs"].values() for rows in per.values()))
  merged["config"]["methods"] = methods
  merged["complete"] = all(r.get("complete") for r in results) and all(
      k in merged["runs"][m].get(n, {}) for k in keys for m in modes for n in methods)
  summarize(merged)
  write(merged, out)
  return merged


def run_processes(args, argv: list[str]) -> None:
  """The methods over `args.processes` child processes at once, then their files merged into --out."""
  import subprocess
  out = Path(args.out)
  groups = split_methods(args.methods, args.processes)
  skip = {"--processes", "--methods", "--out"}
  rest, i = [], 0
  while i < len(argv):                       # the command line without the flags set per child
    if argv[i] in skip:
      i += 1
      while i < len(argv) and not argv[i].startswith("--"):
        i += 1
      continue
    rest.append(argv[i])
    i += 1
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.85 / len(groups):.3f}")
  parts = [out.with_name(f"{out.stem}.part{g}{out.suffix}") for g in range(len(groups))]
  if args.resume and out.is_file():
    for part in parts:
      part.write_text(out.read_text())
  children = []
  for g, (methods, part) in enumerate(zip(groups, parts)):
    cmd = [sys.executable, __file__, *rest, "--out", str(part), "--methods", *methods]
    if g > 0:
      cmd.append("--no-self-check")
    print(f"[invariant] process {g}: {' '.join(methods)}", flush=True)
    children.append(subprocess.Popen(cmd, env=env))
  codes = [c.wait() for c in children]
  merged = merge(parts, out)
  print(f"[invariant] merged {len(parts)} files (exit codes {codes}): complete {merged['complete']}", flush=True)
  print(json.dumps({"summary": merged["summary"], "cost": merged["cost"]}, indent=1))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--prompts", default="mt_bench", help="prompt set name or file")
  ap.add_argument("--limit", type=int, default=20, help="first turns")
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--capacity", type=int, default=1024, help="cache slots (one size: fewer compilations)")
  ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
  ap.add_argument("--budget", type=float, default=None, help="seconds after which no new prompt starts")
  ap.add_argument("--resume", action="store_true", help="continue the run in --out")
  ap.add_argument("--out", required=True)
  ap.add_argument("--processes", type=int, default=1, help="split the methods over this many processes at once")
  ap.add_argument("--no-self-check", action="store_true", help="leave the self-check to another process")
  ap.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="only merge these result files into --out")
  args = ap.parse_args(argv)
  args.methods = sorted(set(args.methods), key=list(METHODS).index)    # plain first: the reference
  if args.merge:
    merged = merge([Path(p) for p in args.merge], Path(args.out))
    print(json.dumps({"summary": merged["summary"], "complete": merged["complete"]}, indent=1))
    return
  if args.processes > 1:
    run_processes(args, list(sys.argv[1:] if argv is None else argv))
    return
  t_start = time.perf_counter()
  compile_cache.enable()      # as the CLI: a rerun with the same shapes loads its compiled programs
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)

  base = api.load(args.model, dtype=args.dtype, invariant=False)
  targets = {"default": base, "invariant": api.batch_invariant(base)}
  questions = load_prompt_set(args.prompts, limit=args.limit)
  prompts = [base.tokenizer.encode_chat([{"role": "user", "content": q.turns[0]}]) for q in questions]
  stop = tuple(base.tokenizer.eos_ids)

  result = json.loads(out.read_text()) if args.resume and out.is_file() else {}
  earlier = set(result.get("earlier_revisions", [])) | ({result["revision"]} if "revision" in result else set())
  earlier.discard(git_revision())
  if earlier:     # a resumed run keeps the revisions its earlier prompts ran at
    result["earlier_revisions"] = sorted(earlier)
  result.update({"experiment": "invariant_equality", "revision": git_revision(), "device": device_info(),
                 "versions": versions(), "config": vars(args), "methods": {k: None if v is None else
                 {"speculator": v[0], "head": None if v[1] is None else str(v[1].relative_to(ROOT)),
                  "draft_params": v[2], "options": v[3]} for k, v in METHODS.items()},
                 "stop_ids": list(stop), "complete": False})
  result.setdefault("runs", {m: {n: {} for n in args.methods} for m in args.modes})
  print(f"[invariant] {device_info()['device_kind']} rev {result['revision']}: {len(prompts)} prompts, "
        f"modes {args.modes}, methods {args.methods}", flush=True)

  if "self_check" not in result:
    result["self_check"] = {}
  for mode in args.modes:
    if mode not in result["self_check"] and not args.no_self_check:
      t0 = time.perf_counter()
      result["self_check"][mode] = self_check(targets[mode], prompts[0], args.capacity)
      print(f"[self-check] {mode}: all bitwise {result['self_check'][mode]['all_bitwise']} "
            f"({time.perf_counter() - t0:.0f} s)", flush=True)
      write(result, out)

  drafters = {mode: build_drafters(targets[mode], args.methods) for mode in args.modes}
  for k, (q, prompt) in enumerate(zip(questions, prompts)):
    if args.budget and time.perf_counter() - t_start > args.budget:
      print(f"[invariant] budget of {args.budget:.0f} s spent: stopping before prompt {k}", flush=True)
      break
    key = str(q.question_id)
    for mode in args.modes:
      runs = result["runs"].setdefault(mode, {})
      for name in args.methods:
        if key in runs.setdefault(name, {}):
          continue
        drafter, dp = drafters[mode].get(name, (None, None))
        t0 = time.perf_counter()
        tokens, seconds = run_once(targets[mode], prompt, drafter, dp, args.new_tokens, args.capacity)
        plain = runs.get("plain", {}).get(key, {}).get("tokens")
        runs[name][key] = {"tokens": tokens, "n_tokens": len(tokens), "seconds": seconds,
                           "equal": None if name == "plain" or plain is None else tokens == plain}
        print(f"[{mode}] {k:3d} {name:13s} {len(tokens) / seconds:8.1f} tok/s  equal {runs[name][key]['equal']}"
              f"  ({time.perf_counter() - t0:.1f} s with warm-up)", flush=True)
        summarize(result)
        write(result, out)
  result["complete"] = all(str(q.question_id) in result["runs"][m][n] for q in questions
                           for m in args.modes for n in args.methods)
  summarize(result)
  write(result, out)
  print(json.dumps({"summary": result["summary"], "cost": result["cost"]}, indent=1))


if __name__ == "__main__":
  main()
