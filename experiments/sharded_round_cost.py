"""Cost of a plain decode step and of a speculative verification round on a sharded target (issue 24's GPU figures).

A target of Llama-3.1-8B shapes with random bf16 weights (`sharding_bench.LLAMA31_8B_SHAPES`; timing
does not depend on the values) on one device and over model = 2 and 4 (those that fit the devices
and divide its 32 heads / 8 KV heads), with a random EAGLE-3 head shaped for it (draft vocabulary
--draft-vocab, MLP as the target's; it accepts next to nothing, which does not change what a round
costs). Per mesh and batch (--batches): ms per plain decode step, ms per EAGLE-3 chain round for
each K (--k) and ms per EAGLE-2 tree round (`eagle3_tree`) for each node budget (--tree-nodes).

Every row is an untimed first call (compilation) and a timed call of `api.generate` with the same
shapes: random prompts of --prompt-len tokens, --new-tokens generated (no stop tokens: the target
has no tokenizer), greedy. The time is the engine's (`Output.seconds`, prefill included, so both
carry its share); the prefill samples the first token, so a plain row runs new tokens - 1 decode
steps (its `rounds`) and a speculative row's `rounds` are the batch's verification rounds (the
most any sequence ran: the batch runs them together); ms per step / round = seconds / rounds. A
row's `ratio_to_plain` is its ms over the plain step's on the same mesh and batch; `ms_per_token`
is seconds over tokens per sequence (with a head that accepts nothing, ~ms per round).

The JSON (config, git revision, device kind and count, rows, skipped) is rewritten after every
row; --budget stops starting rows after that many seconds; --resume keeps the rows of an existing
--out measured at this git revision (same --tiny / --new-tokens / --prompt-len; each row names its
revision; --resume-any-revision keeps older rows too, for code that has not changed since) and
measures only the others, so a run can be spread over calls (compiled programs are kept in specjax's
compile cache, $SPECJAX_HOME/jax_cache, as by the CLI; SPECJAX_COMPILE_CACHE=0 turns it off). The
summary table and the plot (ms per round against K and against tree nodes, a panel per batch, a
line per mesh, the plain step dashed) come at the end, or from a JSON with --plot-only.

  python experiments/sharded_round_cost.py --out $OUT/sharded_round_cost.json        # 2 or 4 GPUs
  python experiments/sharded_round_cost.py --batches 64 --resume --out $OUT/sharded_round_cost.json
  python experiments/sharded_round_cost.py --tiny --batches 1 2 --k 1 2 --tree-nodes 4 \\
      --out /tmp/round_cost_tiny.json     # CPU dry run: a tiny float32 target, 8 simulated devices
  python experiments/sharded_round_cost.py --merge A.json B.json --out $OUT/sharded_round_cost.json

Meshes on disjoint GPUs can be measured at once by separate processes (one device on GPU 0 while
model=2 runs on GPUs 1-2, each with its own CUDA_VISIBLE_DEVICES and --out; each row records the
GPUs it ran on and whether other rows ran beside it); --merge then joins their rows (the first
file's rows win where two measured the same row) into --out, keeping the first file's config.
experiments/gpu/round_cost.sh runs such groups.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--tiny" in sys.argv:   # before jax starts: eight simulated CPU devices
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sharding_bench import LLAMA31_8B_SHAPES, TINY_TARGET, random_target  # noqa: E402
from specjax import api  # noqa: E402
from specjax.bench.env import device_info, git_revision  # noqa: E402
from specjax.drafters.base import DraftParams  # noqa: E402
from specjax.drafters.eagle3 import Eagle3Config, init_head  # noqa: E402
from specjax.drafters.eagle3_drafter import make_eagle3_drafter  # noqa: E402

SAME = ("tiny", "new_tokens", "prompt_len")     # config keys a resumed file must share


def mesh_name(m: int) -> str:
  return "one device" if m == 1 else f"data=1,model={m}"


def label(method: str, width: int | None, heads: str = "replicated") -> str:
  name = {"plain": "plain", "eagle3": f"eagle3 K={width}", "eagle3_tree": f"eagle3_tree N={width}"}[method]
  return name + (" split" if heads == "sharded" else "")


def heads_of(r: dict) -> str:
  """Where a row's head was (rows written before the option: replicated)."""
  return r.get("heads", "replicated")


class RoundCost:
  """The target on each mesh, the head, and the rows (measured, resumed, skipped) -> the JSON."""

  def __init__(self, args, target, head, hc, d2t, prompts, meta: dict, rows: list[dict]):
    self.args, self.target, self.head, self.hc, self.d2t, self.prompts = args, target, head, hc, d2t, prompts
    self.meta, self.rows, self.skipped, self.sharded = meta, rows, [], {}
    self.t0 = time.monotonic()

  def on(self, m: int, batch: int):
    if m not in self.sharded:
      self.sharded[m] = self.target if m == 1 else api.shard(self.target, mesh_name(m))
      if m > 1:
        self.count_collectives(m, batch)
    return self.sharded[m]

  def count_collectives(self, m: int, batch: int) -> None:
    """The collectives XLA compiles into one plain decode step on this mesh at the batch of its first
    row (per layer, outside the layers; those outside depend on the batch)."""
    from specjax.parallel.hlo import decode_step_collectives
    sharded = self.sharded[m]
    try:
      dtype = jax.tree_util.tree_leaves(sharded.params)[0].dtype
      got = decode_step_collectives(sharded.logical_cfg, sharded.mesh, batch, dtype=dtype)
    except Exception as e:  # noqa: BLE001  (recorded: the timings do not depend on it)
      got = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    self.meta.setdefault("collectives", {})[f"{mesh_name(m)}, batch {batch}"] = got
    print(f"[round_cost] collectives of a decode step, {mesh_name(m)}, batch {batch}: {got}", flush=True)

  def row(self, m: int, batch: int, method: str, width: int | None, heads: str = "replicated") -> None:
    key = dict(mesh=mesh_name(m), batch=batch, method=method, width=width, heads=heads)
    if any(all((heads_of(r) if k == "heads" else r.get(k)) == v for k, v in key.items()) for r in self.rows):
      return                                                   # measured already (--resume)
    if time.monotonic() - self.t0 > self.args.budget:
      self.skipped.append({**key, "why": "time budget"})
      return
    try:
      self._row(m, batch, method, width, heads, key)
    except Exception as e:  # noqa: BLE001  (out of memory, a drafter the mesh cannot take): recorded
      self.skipped.append({**key, "why": f"{type(e).__name__}: {str(e)[:400]}"})
      print(f"[round_cost] {key}: {type(e).__name__}: {str(e)[:400]}", flush=True)
    self.write()

  def _row(self, m, batch, method, width, heads, key):
    target = dataclasses.replace(self.on(m, batch), head_placement=heads)
    kw: dict = {}
    if method == "eagle3":
      kw["draft_params"] = {"n_max": width}
      kw["speculator"] = make_eagle3_drafter(target, self.head, DraftParams(n_max=width), hc=self.hc, d2t=self.d2t)
    elif method == "eagle3_tree":
      kw["speculator"] = make_eagle3_drafter(target, self.head, tree=True, hc=self.hc, d2t=self.d2t, n_nodes=width,
                                             depth=self.args.tree_depth, top_k=self.args.tree_top_k)
    run = lambda: api.generate(target, self.prompts[:batch], chat=False, max_new_tokens=self.args.new_tokens,
                               sampling={"temperature": 0.0}, stop_at_eos=False, **kw)
    t = time.perf_counter()
    run()                                                      # compilation (and a first run)
    first = time.perf_counter() - t
    out = run()
    tokens = sum(len(x) for x in out.tokens)
    if out.stats is None:
      rounds, tau = self.args.new_tokens - 1, 1.0           # the prefill sampled the first token
    else:
      rounds, tau = max(out.stats.per_seq_rounds[:batch]), out.stats.tau
    ms = 1e3 * out.seconds / max(rounds, 1)
    plain = next((r for r in self.rows if r["mesh"] == key["mesh"] and r["batch"] == batch and r["method"] == "plain"),
                 None)
    r = {**key, "label": label(method, width, heads), "ms_per_round": round(ms, 3), "rounds": rounds, "tokens": tokens,
         "tau": round(tau, 3), "ms_per_token": round(1e3 * out.seconds / max(tokens / batch, 1e-9), 3),
         "ratio_to_plain": round(ms / plain["ms_per_round"], 3) if plain else None,
         "seconds": round(out.seconds, 4), "first_call_s": round(first, 1), "git_revision": self.meta["git_revision"],
         "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "all"), "beside": os.environ.get("SPECJAX_BESIDE", "")}
    self.rows.append(r)
    print(json.dumps(r), flush=True)

  def write(self) -> None:
    out = {"experiment": "sharded_round_cost", **self.meta, "rows": self.rows, "skipped": self.skipped,
           "elapsed_s": round(time.monotonic() - self.t0, 1)}
    Path(self.args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(self.args.out).write_text(json.dumps(out, indent=1) + "\n")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model-sizes", type=int, nargs="+", default=[1, 2, 4], help="model axis sizes (those that fit)")
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
  ap.add_argument("--k", type=int, nargs="*", default=[1, 2, 4, 8], help="EAGLE-3 chain draft lengths")
  ap.add_argument("--tree-nodes", type=int, nargs="*", default=[16, 32, 64], help="eagle3_tree node budgets")
  ap.add_argument("--head-placement", nargs="+", choices=("replicated", "sharded"), default=["replicated"],
                  help="the EAGLE-3 head on a sharded mesh: whole on every device, split over model, or both (rows each)")
  ap.add_argument("--tree-depth", type=int, default=6)
  ap.add_argument("--tree-top-k", type=int, default=8)
  ap.add_argument("--draft-vocab", type=int, default=32000, help="the head's vocabulary (EAGLE-3 Llama-3.1-8B: 32000)")
  ap.add_argument("--new-tokens", type=int, default=64, help="at least 2")
  ap.add_argument("--prompt-len", type=int, default=128)
  ap.add_argument("--budget", type=float, default=480.0, help="seconds after which no new row starts")
  ap.add_argument("--tiny", action="store_true", help="a tiny float32 target on 8 simulated CPU devices")
  ap.add_argument("--resume", action="store_true",
                  help="keep the rows of an existing --out measured at this git revision, measure the rest")
  ap.add_argument("--resume-any-revision", action="store_true", help="with --resume, keep older revisions' rows too")
  ap.add_argument("--out", required=True)
  ap.add_argument("--plot-only", action="store_true", help="print the summary and draw the PNG of --out")
  ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                  help="join the rows of these files (runs on disjoint GPUs) into --out, then report")
  args = ap.parse_args(argv)
  if args.merge:
    merged = merge([json.loads(Path(f).read_text()) for f in args.merge if Path(f).exists()])
    Path(args.out).write_text(json.dumps(merged, indent=1) + "\n")
    report(merged, Path(args.out).with_suffix(".png"))
    return 0
  if args.plot_only:
    report(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
    return 0

  from specjax.io import compile_cache
  compile_cache.enable()
  cfg, dtype = (TINY_TARGET, jnp.float32) if args.tiny else (LLAMA31_8B_SHAPES, jnp.bfloat16)
  target = random_target(cfg, f"{'tiny' if args.tiny else 'Llama-3.1-8B shapes'} (random {jnp.dtype(dtype).name})",
                         dtype=dtype)
  dv = min(args.draft_vocab, (3 * cfg.vocab_size) // 4) if args.tiny else args.draft_vocab
  hc = Eagle3Config.make(cfg, dv)
  d2t = np.arange(dv, dtype=np.int32)                          # any sorted draft vocabulary: cost only
  head = init_head(hc, 7, dtype, target_params=target.params, d2t=d2t)
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(1, cfg.vocab_size, args.prompt_len)] for _ in range(max(args.batches))]
  n_dev = jax.device_count()
  meta = {"config": vars(args), "git_revision": git_revision(), "device": device_info(),
          "target": {"name": target.name, "cfg": repr(cfg)}, "head": repr(hc),
          "xla_flags": os.environ.get("XLA_FLAGS", "")}
  rows, old_skips = [], []
  methods = [("plain", None)] + [("eagle3", k) for k in args.k] + [("eagle3_tree", n) for n in args.tree_nodes]
  if args.resume and Path(args.out).exists():
    old = json.loads(Path(args.out).read_text())
    if all(old["config"].get(k) == meta["config"][k] for k in SAME):
      keep = lambda r: args.resume_any_revision or r.get("git_revision") == meta["git_revision"]
      rows = [r for r in old["rows"] if keep(r)]
      print(f"[round_cost] resuming {len(rows)} of the {len(old['rows'])} rows of {args.out}", flush=True)
      if old.get("git_revision") == meta["git_revision"] or args.resume_any_revision:
        # what the earlier runs compiled and could not run stays on record, unless this run tries it
        meta["collectives"] = dict(old.get("collectives", {}))
        tried = lambda s: (s.get("batch") in args.batches and s.get("mesh") in map(mesh_name, args.model_sizes)
                           and (s.get("method"), s.get("width")) in methods)
        old_skips = [s for s in old.get("skipped", []) if "method" in s and not tried(s)]
  bench = RoundCost(args, target, head, hc, d2t, prompts, meta, rows)
  bench.skipped.extend(old_skips)
  sizes = []
  for m in args.model_sizes:
    if m > n_dev or cfg.n_heads % m or cfg.n_kv_heads % m:
      bench.skipped.append({"mesh": mesh_name(m), "why": f"{n_dev} devices" if m > n_dev else
                            f"model={m} does not divide {cfg.n_heads} heads / {cfg.n_kv_heads} KV heads"})
    else:
      sizes.append(m)
  bench.write()
  for b in args.batches:                                       # a cut run has every mesh at the first batches
    for m in sizes:
      for method, width in methods:
        for heads in (["replicated"] if m == 1 or method == "plain" else args.head_placement):
          bench.row(m, b, method, width, heads)
  bench.write()
  report(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
  return 0


def merge(outs: list[dict]) -> dict:
  """One result from several runs' (the first's config and device; every row once, the first
  file's where two measured it; a row's `gpus` says where it ran). The device count is the most
  any run saw: the machine's, when the runs split its GPUs."""
  if not outs:
    raise SystemExit("--merge: none of the files exists")
  key = lambda r: (r["mesh"], r["batch"], r["method"], r["width"], heads_of(r))
  rows: dict = {}
  for o in outs:
    for r in o["rows"]:
      rows.setdefault(key(r), r)
  # a skip stays unless a row was measured where it points (a mesh one run lacked GPUs for, another ran)
  hit = lambda s: any(all((heads_of(r) if k == "heads" else r.get(k)) == v for k, v in s.items() if k != "why")
                      for r in rows.values())
  skipped = [s for o in outs for s in o.get("skipped", []) if not hit(s)]
  device = {**outs[0].get("device", {}), "n_devices": max(o.get("device", {}).get("n_devices", 0) for o in outs)}
  collectives = {k: v for o in reversed(outs) for k, v in o.get("collectives", {}).items()}
  return {**outs[0], "device": device, "rows": list(rows.values()), "skipped": skipped, "collectives": collectives,
          "elapsed_s": round(sum(o.get("elapsed_s", 0) for o in outs), 1), "merged_from": len(outs)}


def summary(out: dict) -> list[str]:
  """A table: a line per (mesh, batch), ms per step / round and the ratio to the plain step."""
  rows = out["rows"]
  cols = list(dict.fromkeys(r["label"] for r in sorted(rows, key=lambda r: (r["method"] != "plain",
                                                                              r["method"], r["width"] or 0))))
  lines = [f"{'mesh':17s} {'batch':>5s} " + " ".join(f"{c:>18s}" for c in cols)]
  for mesh, b in dict.fromkeys((r["mesh"], r["batch"]) for r in rows):
    got = {r["label"]: r for r in rows if r["mesh"] == mesh and r["batch"] == b}
    cell = lambda r: "-" if r is None else f"{r['ms_per_round']:.2f} ms" + (
      f" {r['ratio_to_plain']:.2f}x" if r["method"] != "plain" and r["ratio_to_plain"] else "")
    lines.append(f"{mesh:17s} {b:5d} " + " ".join(f"{cell(got.get(c)):>18s}" for c in cols))
  cut = sum(s.get("why") == "time budget" for s in out.get("skipped", []))
  return lines + [f"skipped {s}" for s in out.get("skipped", []) if s.get("why") != "time budget"] + \
      ([f"not started (time budget): {cut} rows"] if cut else []) + \
      [f"collectives of a decode step, {k}: {v}" for k, v in out.get("collectives", {}).items()]


def report(out: dict, png: Path) -> None:
  print("[round_cost] ms per plain step / verification round (x: over the plain step)\n  "
        + "\n  ".join(summary(out)), flush=True)
  plot(out, png)


def plot(out: dict, png: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = out["rows"]
  batches = sorted({r["batch"] for r in rows})
  if not batches:
    return
  fig, axes = plt.subplots(2, len(batches), figsize=(4.5 * len(batches), 7), squeeze=False)
  meshes = list(dict.fromkeys(r["mesh"] for r in rows))
  for j, b in enumerate(batches):
    for i, (method, xlabel) in enumerate((("eagle3", "K (EAGLE-3 chain draft tokens)"),
                                          ("eagle3_tree", "tree nodes (eagle3_tree)"))):
      ax = axes[i][j]
      for c, mesh in enumerate(meshes):
        color = f"C{c}"
        for heads, style in (("replicated", "-o"), ("sharded", ":s")):
          rs = sorted((r for r in rows if r["mesh"] == mesh and r["batch"] == b and r["method"] == method
                       and heads_of(r) == heads), key=lambda r: r["width"])
          if rs:
            ax.plot([r["width"] for r in rs], [r["ms_per_round"] for r in rs], style, color=color,
                    label=mesh + (", head split" if heads == "sharded" else ""))
        for r in rows:
          if r["mesh"] == mesh and r["batch"] == b and r["method"] == "plain":
            ax.axhline(r["ms_per_round"], ls="--", color=color, lw=1, label=f"plain step, {mesh}")
      widths = sorted({r["width"] for r in rows if r["method"] == method})
      ax.set_xscale("log", base=2)
      ax.set_xticks(widths, [str(w) for w in widths])
      ax.set_xlabel(xlabel)
      ax.set_ylabel("ms per round")
      ax.set_title(f"batch {b}", fontsize=9)
      ax.grid(alpha=0.3)
      ax.legend(fontsize=6)
  dev = out.get("device", {})
  fig.suptitle(f"{out.get('target', {}).get('name', '?')}: verification round cost by mesh; "
               f"{dev.get('n_devices', '?')} x {dev.get('device_kind', '?')}, rev {out.get('git_revision', '?')}",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(png, dpi=110)


if __name__ == "__main__":
  sys.exit(main())
