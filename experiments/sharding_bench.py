"""Speed and equality of sharded decoding against one device (issue 24's GPU figures).

Two questions, on every device of one host:

(a) data parallel: SmolLM2 (real weights) on MT-bench first turns, greedy, plain decoding,
    ngram_simple and MTP (the committed head), at global batch 8 / 32 / 64, on mesh data=N (N = the
    device count) beside one device;
(b) model parallel: a target of Llama-3.1-8B shapes with random bf16 weights (timing does not
    depend on the values; SmolLM2 is too small for tensor parallelism to pay) at model = 2 and 4
    (those that fit the devices) beside one device, batch 1 and 8, plain decoding. The real-weights
    target runs over every --model-sizes that fits the devices, each of --methods (speculation on
    real weights under tensor parallelism): SmolLM2 (9 heads, 3 KV heads) is padded to 12 / 4 heads
    with zero KV groups when the size does not divide 3 (`partition.pad_heads`: the same output,
    1.33x the KV cache and attention); Qwen2.5-Coder-0.5B (--model qwen2.5-coder-0.5b-instruct, 14 / 2
    heads) shards over 2 as it is.

Every row is an untimed first call (compilation) and a timed call of `api.generate` with the same
shapes; tokens/s counts the tokens generated (stops at EOS included). A sharded row's speedup is
over the one-device row of the same model, method and batch, measured in the same process; its
tokens are compared with that row's: the fraction of sequences equal token for token and the
fraction of tokens equal before the first difference (bf16 float sums in another order can flip a
near-tie, so sharded bf16 output is not always identical; float32 is, see tests/test_sharding.py).

Beside the timings, the collectives XLA compiles into one plain decode step of each sharded target
(`specjax.parallel.hlo.decode_step_collectives`: all-gather / all-reduce / collective-permute / ...
per decoder layer and outside the layers, compiled from abstract values) go into the JSON
(`collectives`) and the summary printed at the end.

The JSON (config, git revision, device kind and count, rows) is rewritten after every row, so a
run cut by a time limit keeps what it measured; --budget stops starting rows after that many
seconds. The summary and the plot (tokens/s against batch, one panel per model, one line per method
and mesh) come at the end, or from a JSON with --plot-only.

  python experiments/sharding_bench.py --out $OUT/sharding.json --mtp-head HEAD
  python experiments/sharding_bench.py --tiny --out /tmp/sharding_tiny.json     # CPU dry run, 8 fake devices
  python experiments/sharding_bench.py --model qwen2.5-coder-0.5b-instruct --methods plain ngram_simple \
      --batches 8 --no-large --out $OUT/sharding_qwen05.json    # real weights, speculative, model=2 beside one device
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--tiny" in sys.argv:   # before jax starts: eight simulated CPU devices
  import os
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specjax import api  # noqa: E402
from specjax.bench.env import device_info, git_revision  # noqa: E402
from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.load import LoadedModel  # noqa: E402

# Llama-3.1-8B's shapes (HF config.json), weights random
# SmolLM2-135M's shapes: with random weights, the same kernels and launches as the real model
SMOLLM2_SHAPES = ModelConfig(arch="llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                             head_dim=64, ffn_dim=1536, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True)
LLAMA31_8B_SHAPES = ModelConfig(arch="llama", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                head_dim=128, ffn_dim=14336, rope_theta=500000.0,
                                rope_scaling=("llama3", 8.0, 1.0, 4.0, 8192), norm_eps=1e-5)
# Qwen2.5-Coder-1.5B's shapes (the target of the Qwen draft pair; untied head, QKV bias)
QWEN25_15B_SHAPES = ModelConfig(arch="qwen2", vocab_size=151936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2,
                                head_dim=128, ffn_dim=8960, rope_theta=1e6, qkv_bias=True)
RANDOM_SHAPES = {"smollm2": SMOLLM2_SHAPES, "qwen2.5-1.5b": QWEN25_15B_SHAPES, "llama-3.1-8b": LLAMA31_8B_SHAPES}
# --tiny: shardable stand-ins (8 / 4 heads divide model = 2 and 4)
TINY_TARGET = ModelConfig(arch="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=4,
                          ffn_dim=64, norm_eps=1e-6)
TINY_LARGE = TINY_TARGET.replace(n_layers=3, d_model=64, n_heads=16, n_kv_heads=8, ffn_dim=128)

NGRAM = dict(speculator="ngram_simple", options={"size_n": 3, "size_m": 16}, draft_params={"n_max": 8, "n_min": 1})


def describe_collectives(got: dict) -> str:
  """"per layer: all-reduce 2; outside the layers: all-gather 5, ..." (zero counts left out)."""
  if "error" in got:
    return got["error"]
  say = lambda counts: ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "none"
  return f"per layer: {say(got['per_layer'])}; outside the layers: {say(got['outside_layers'])}"


def summary(out: dict) -> list[str]:
  """One line per sharded row (speedup, equality) and per sharded target (its collectives)."""
  lines = [f"{r['model']} {r['method']} b{r['batch']} {r['mesh']}: {r['tok_s']} tok/s, "
           f"{r['speedup_vs_one_device']}x one device, {r['equal_sequences']:.0%} sequences equal"
           for r in out["rows"] if "speedup_vs_one_device" in r]
  return lines + [f"collectives of a decode step, {k}: {describe_collectives(v)}"
                  for k, v in out.get("collectives", {}).items()]


DFLASH_HEAD = "assets/smollm2/dflash/dflash.safetensors"


def method_kwargs(name: str, mtp_head, dflash_head: str = DFLASH_HEAD) -> dict:
  if name == "plain":
    return {}
  if name == "ngram_simple":
    return dict(NGRAM)
  if name == "mtp":
    return dict(speculator="mtp", head=mtp_head, draft_params={"n_max": 3})
  if name == "dflash_tree":                   # the best head at batch 1 (experiments/README)
    return dict(speculator="dflash_tree", head=dflash_head, options={"n_nodes": 32})
  raise SystemExit(f"unknown method {name!r} (plain, ngram_simple, mtp, dflash_tree)")


def random_target(cfg: ModelConfig, label: str, seed: int = 0, dtype=jnp.bfloat16) -> LoadedModel:
  from specjax.models.decoder import init_params
  return LoadedModel(name=label, cfg=cfg, params=init_params(cfg, seed=seed, dtype=dtype))


def equality(got: list[list[int]], ref: list[list[int]]) -> dict:
  """Fraction of sequences equal to the reference, and of reference tokens matched before the
  first difference."""
  same = sum(g == r for g, r in zip(got, ref))
  prefix = 0
  for g, r in zip(got, ref):
    n = next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
    prefix += n
  total = sum(len(r) for r in ref)
  return {"equal_sequences": same / len(ref), "equal_prefix_tokens": prefix / max(total, 1)}


class Bench:
  """Runs rows, keeps the one-device tokens and speed of each (model, method, batch), writes the JSON."""

  def __init__(self, args, meta: dict):
    self.args, self.meta, self.rows, self.skipped = args, meta, [], []
    self.ref: dict[tuple, dict] = {}
    self.t0 = time.monotonic()
    self.sharded: dict[tuple, LoadedModel] = {}
    self.collectives: dict[str, dict] = {}

  def target_on(self, target: LoadedModel, mesh: str | None, batch: int) -> LoadedModel:
    if mesh is None:
      return target
    key = (target.name, mesh)
    if key not in self.sharded:
      self.sharded[key] = api.shard(target, mesh)
      self.count_collectives(self.sharded[key], mesh, batch)
    return self.sharded[key]

  def count_collectives(self, sharded: LoadedModel, mesh: str, batch: int) -> None:
    """The collectives of one plain decode step of `sharded` on its mesh, per layer and outside."""
    from specjax import parallel
    from specjax.parallel.hlo import decode_step_collectives
    name = f"{sharded.name} | {mesh}"
    try:
      dtype = jax.tree_util.tree_leaves(sharded.params)[0].dtype
      got = decode_step_collectives(sharded.cfg, sharded.mesh, parallel.padded_batch(batch, sharded.mesh), dtype=dtype)
    except Exception as e:  # noqa: BLE001
      got = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    self.collectives[name] = got
    print(f"[sharding_bench] collectives of a decode step, {name}: {describe_collectives(got)}", flush=True)

  def row(self, section: str, target: LoadedModel, method: str, batch: int, mesh: str | None, prompts, mtp_head):
    """One row; a failure (out of memory, a mesh the target cannot take) is recorded, not raised."""
    try:
      self._row(section, target, method, batch, mesh, prompts, mtp_head)
    except Exception as e:  # noqa: BLE001
      self.skipped.append({"section": section, "model": target.name, "method": method, "batch": batch,
                           "mesh": mesh or "one device", "why": f"{type(e).__name__}: {str(e)[:300]}"})
      print(f"[sharding_bench] {target.name} {method} b{batch} {mesh}: {type(e).__name__}: {e}", flush=True)
      self.write()

  def _row(self, section, target, method, batch, mesh, prompts, mtp_head):
    if time.monotonic() - self.t0 > self.args.budget:
      self.skipped.append({"section": section, "model": target.name, "method": method, "batch": batch,
                           "mesh": mesh or "one device", "why": "time budget"})
      return
    key = (target.name, method, batch)
    if (mesh is None and key in self.ref) or (mesh is not None and key not in self.ref):
      return                                # measured already / no one-device row to compare with
    on = self.target_on(target, mesh, batch)
    kw = method_kwargs(method, mtp_head, self.args.dflash_head)
    run = lambda: api.generate(on, prompts[:batch], chat=False, max_new_tokens=self.args.new_tokens,
                               sampling={"temperature": 0.0}, **kw)
    t = time.perf_counter()
    run()                                   # compilation (and a first run)
    first = time.perf_counter() - t
    out = min((run() for _ in range(self.args.repeats)), key=lambda o: o.seconds)
    n = sum(len(t) for t in out.tokens)
    r = {"section": section, "model": target.name, "method": method, "batch": batch,
         "mesh": mesh or "one device", "tokens": n, "seconds": round(out.seconds, 4),
         "tok_s": round(n / out.seconds, 1), "first_call_s": round(first, 1)}
    if out.stats is not None:
      r["tau"] = round(out.stats.tau, 3)
    if mesh is None:
      self.ref[key] = {"tokens": out.tokens, "tok_s": n / out.seconds}
    else:
      ref = self.ref[key]
      r["speedup_vs_one_device"] = round(r["tok_s"] / ref["tok_s"], 3)
      r.update({k: round(v, 4) for k, v in equality(out.tokens, ref["tokens"]).items()})
    self.rows.append(r)
    print(json.dumps(r), flush=True)
    self.write()

  def write(self):
    out = {"experiment": "sharding", **self.meta, "rows": self.rows, "skipped": self.skipped,
           "collectives": self.collectives, "elapsed_s": round(time.monotonic() - self.t0, 1)}
    Path(self.args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(self.args.out).write_text(json.dumps(out, indent=1) + "\n")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="smollm2-135m-instruct", help="the real-weights target (data parallel)")
  ap.add_argument("--mtp-head", default="assets/smollm2/mtp/mtp_head.safetensors")
  ap.add_argument("--dflash-head", default=DFLASH_HEAD, help="the DFlash head of method dflash_tree (32 nodes)")
  ap.add_argument("--methods", nargs="+", default=["plain", "ngram_simple", "mtp"],
                  help="plain, ngram_simple, mtp, dflash_tree")
  ap.add_argument("--batches", type=int, nargs="*", default=[8, 64, 32],
                  help="data parallel, in this order (none: no data-parallel rows)")
  ap.add_argument("--mp-batches", type=int, nargs="+", default=[1, 8], help="model parallel")
  ap.add_argument("--model-sizes", type=int, nargs="+", default=[2, 4], help="model axis sizes (those that fit)")
  ap.add_argument("--data", type=int, default=None, help="data axis size (default: every device)")
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=1, help="timed calls per row (the fastest is kept)")
  ap.add_argument("--budget", type=float, default=420.0, help="seconds after which no new row starts")
  ap.add_argument("--tiny", action="store_true", help="tiny random targets on 8 simulated CPU devices")
  ap.add_argument("--no-large", action="store_true", help="skip the random Llama-3.1-8B-shaped target")
  ap.add_argument("--out", required=True)
  ap.add_argument("--plot-only", action="store_true",
                  help="print the summary and draw the PNG of an existing --out JSON")
  args = ap.parse_args(argv)
  if args.plot_only:
    report(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
    return 0

  n_dev = jax.device_count()
  if args.tiny:
    from specjax.drafters.mtp import init_heads
    target = random_target(TINY_TARGET, "tiny target (random)")
    large = random_target(TINY_LARGE, "tiny large (random)", seed=1)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, TINY_TARGET.vocab_size, int(rng.integers(3, 12)))) for _ in range(max(args.batches + args.mp_batches))]
    prompts = [[int(t) for t in p] for p in prompts]
    mtp_head = init_heads(TINY_TARGET, 2, seed=1)
  else:
    from specjax.bench.prompts import load_prompt_set
    target = api.load(args.model, dtype="bfloat16")
    questions = load_prompt_set("mt_bench")
    texts = [q.turns[0] for q in questions]
    texts = [texts[i % len(texts)] for i in range(max(args.batches + args.mp_batches))]
    prompts = api.encode_prompts(target, texts, chat=True)
    mtp_head = args.mtp_head
    large = None if args.no_large else random_target(LLAMA31_8B_SHAPES, "Llama-3.1-8B shapes (random bf16 weights)")
  meta = {"config": {**vars(args), "n_prompts": len(prompts)}, "git_revision": git_revision(),
          "device": device_info(), "models": {target.name: repr(target.cfg)}}
  if large is not None:
    meta["models"][large.name] = repr(large.cfg)
  bench = Bench(args, meta)
  bench.write()
  n_data = min(args.data or n_dev, n_dev)
  data_mesh = f"data={n_data}" if n_data > 1 else None
  sizes = [m for m in args.model_sizes if m <= n_dev]
  # the real-weights target over every model size that fits the devices (KV heads the size does not
  # divide are padded with zero heads when sharded: `partition.pad_heads`)
  smol_sizes = [m for m in args.model_sizes if 2 <= m <= n_dev]

  def data_parallel(batches):
    for b in batches:
      for method in args.methods:
        for mesh in [None] + ([data_mesh] if data_mesh else []):
          bench.row("data_parallel", target, method, b, mesh, prompts, mtp_head)

  def model_parallel(model: LoadedModel, model_sizes, method="plain"):
    for b in args.mp_batches:
      for m in [None] + [f"data=1,model={m}" for m in model_sizes]:
        bench.row("model_parallel", model, method, b, m, prompts, mtp_head)

  # the first data-parallel batch, the large target, the other batches, SmolLM2 over model
  data_parallel(args.batches[:1])
  if large is not None and sizes:
    model_parallel(large, sizes)
  data_parallel(args.batches[1:])
  if smol_sizes:                            # the real-weights target over model, each method
    for method in args.methods:
      model_parallel(target, smol_sizes, method)
  for m in args.model_sizes:
    if m not in smol_sizes:
      bench.skipped.append({"section": "model_parallel", "model": target.name, "mesh": f"data=1,model={m}",
                            "why": f"{n_dev} devices"})
  bench.write()
  report(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
  return 0


def report(out: dict, png: Path) -> None:
  """The summary printed and the plot drawn (also from a JSON a time limit cut: --plot-only)."""
  print("[sharding_bench] summary\n  " + "\n  ".join(summary(out)), flush=True)
  plot(out, png)


def plot(out: dict, png: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  models = list(dict.fromkeys(r["model"] for r in out["rows"]))
  if not models:
    return
  fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
  colors = {"plain": "tab:blue", "ngram_simple": "tab:orange", "mtp": "tab:green"}
  for ax, model in zip(axes[0], models):
    rows = [r for r in out["rows"] if r["model"] == model]
    meshes = list(dict.fromkeys(r["mesh"] for r in rows))
    for method in dict.fromkeys(r["method"] for r in rows):
      for i, mesh in enumerate(meshes):
        rs = sorted((r for r in rows if r["method"] == method and r["mesh"] == mesh), key=lambda r: r["batch"])
        if rs:
          ax.plot([r["batch"] for r in rs], [r["tok_s"] for r in rs], ["-o", "--s", ":^", "-.v"][i % 4],
                  color=colors.get(method), label=f"{method}, {mesh}")
    batches = sorted({r["batch"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("global batch")
    ax.set_ylabel("tokens / s")
    ax.set_title(model, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  dev = out.get("device", {})
  fig.suptitle(f"sharded decoding vs one device: {dev.get('n_devices', '?')} x {dev.get('device_kind', '?')}, "
               f"rev {out.get('git_revision', '?')}", fontsize=10)
  fig.tight_layout()
  fig.savefig(png, dpi=110)


if __name__ == "__main__":
  sys.exit(main())
