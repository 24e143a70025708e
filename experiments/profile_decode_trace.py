"""Where a plain decode step's time goes on the device: a profiler trace of generation, kernel by kernel.

`decode_flags.py` counts the kernels XLA compiles a step into; this records what runs. It traces plain
generation (`generate_plain`, compiled first) with `jax.profiler.trace` at each --batch, reads the
trace's device events (the Perfetto JSON the profiler writes: every kernel on every GPU stream, with
its start and duration) and reports per decode step:

- wall ms (the traced generation over its tokens) against device-busy ms (the union of kernel
  intervals) and the sum of kernel durations: busy well below wall means the device waits (for the
  host, for launches); busy near wall means the kernels themselves are the cost;
- kernels per step, and the gaps between consecutive kernels (median, p90, their sum per step);
- the kernels grouped by name (count per step, mean us, share of busy time) and by kind (GEMM,
  fusion, Triton / Pallas, copy / memset, other), top --top names, each with its output shape and
  the JAX operation it came from (read off the decode loop's compiled HLO, `hlo_index`).

Steps: the generation runs --new-tokens tokens; per-step figures divide by that count (the prefill
is one kernel set among them, its share shown by the generation at --new-tokens vs 2x when
--prefill-check is given). The raw trace (`.json.gz`) is kept beside the JSON with --keep-trace.

  python experiments/profile_decode_trace.py --random-shape --out $OUT/decode_trace.json        # GPU
  python experiments/profile_decode_trace.py --tiny --batch 1 --new-tokens 8 --out /tmp/t.json   # CPU dry run
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# names of the project's Pallas kernels that no generic rule below recognises
PALLAS_NAMES = {"norm_qkv_rope", "matmul_residual", "norm_gate_up", "accept_sample", "invariant_matmul", "invariant_rmsnorm"}


def kernel_kind(name: str) -> str:
  """A kernel's kind from its name (cuBLAS / CUTLASS GEMMs, XLA fusions, Triton / Pallas kernels,
  copies and memsets)."""
  n = name.lower()
  if n.split("__")[0] in PALLAS_NAMES:   # the fused decode kernels' names (a `__N` suffix per instance)
    return "triton/pallas"
  if any(k in n for k in ("gemm", "gemv", "cublas", "cutlass", "sm90_xmma", "nvjet", "matmul", "dot")):
    return "gemm"
  if any(k in n for k in ("memcpy", "memset", "copy")):
    return "copy/memset"
  if "triton" in n or "pallas" in n or "attention" in n:     # Pallas kernels carry their function's name
    return "triton/pallas"
  if "fusion" in n or "loop_" in n or "input_" in n or "reduce" in n:
    return "fusion"
  return "other"


_HLO_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+?)\s+(fusion|custom-call|copy|[a-z\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def hlo_index(hlo_text: str) -> dict[str, dict]:
  """What each kernel-launching instruction of a compiled module is, by the name a profiler trace
  gives its kernel (the instruction's name with '.' as '_'): {name: {"shape", "op", "op_name"}}, the
  op_name being the JAX operation it was lowered from (a fusion's own metadata: its root's)."""
  out = {}
  for line in hlo_text.splitlines():
    m = _HLO_INSTR.match(line)
    if not m or m.group(3) in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
      continue
    op_name = _OP_NAME.search(line)
    out[m.group(1).replace(".", "_")] = {"shape": m.group(2), "op": m.group(3),
                                         "op_name": op_name.group(1) if op_name else ""}
  return out


def device_events(trace: dict | list) -> list[dict]:
  """The trace's complete events ('X') of device processes (process name with '/device:'), each
  {name, ts, dur, stream} in microseconds; host events are left out."""
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  procs = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  dev = {pid for pid, name in procs.items() if "/device:" in name}
  out = []
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in dev and float(e.get("dur", 0)) > 0:
      out.append({"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"]),
                  "stream": threads.get((e["pid"], e.get("tid")), str(e.get("tid")))})
  return out


def summarize(kernels: list[dict], steps: int, wall_s: float, top: int, hlo: dict | None = None) -> dict:
  """Per-step figures of one traced generation: busy vs wall, gaps, kernels by name and by kind;
  `hlo` (`hlo_index` of the program) adds each top kernel's output shape and JAX operation."""
  kernels = sorted(kernels, key=lambda k: k["ts"])
  busy, gaps = 0.0, []
  end = None
  for k in kernels:                                        # the union of the kernels' intervals
    s, e = k["ts"], k["ts"] + k["dur"]
    if end is None or s >= end:
      if end is not None:
        gaps.append(s - end)
      busy += e - s
      end = e
    elif e > end:
      busy += e - end
      end = e
  total = sum(k["dur"] for k in kernels)
  by_name: dict[str, list[float]] = defaultdict(list)
  for k in kernels:
    by_name[k["name"]].append(k["dur"])
  by_kind: dict[str, float] = defaultdict(float)
  kind_count: dict[str, int] = defaultdict(int)
  for name, durs in by_name.items():
    by_kind[kernel_kind(name)] += sum(durs)
    kind_count[kernel_kind(name)] += len(durs)
  names = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
  q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0
  return {
      "steps": steps,
      "wall_ms_per_step": round(1e3 * wall_s / steps, 4),
      "busy_ms_per_step": round(busy / 1e3 / steps, 4),
      "kernel_ms_per_step": round(total / 1e3 / steps, 4),
      "busy_over_wall": round(busy / 1e6 / wall_s, 3) if wall_s > 0 else None,
      "kernels_per_step": round(len(kernels) / steps, 1),
      "mean_kernel_us": round(total / len(kernels), 2) if kernels else 0.0,
      "gap_us": {"median": round(statistics.median(gaps), 2) if gaps else 0.0, "p90": round(q(gaps, 0.9), 2),
                 "sum_ms_per_step": round(sum(gaps) / 1e3 / steps, 4)},
      "streams": sorted({k["stream"] for k in kernels}),
      "by_kind": {kind: {"per_step": round(kind_count[kind] / steps, 1), "ms_per_step": round(t / 1e3 / steps, 4),
                         "share": round(t / total, 3) if total else 0.0}
                  for kind, t in sorted(by_kind.items(), key=lambda kv: -kv[1])},
      "top_kernels": [{"name": n[:160], "kind": kernel_kind(n), "per_step": round(len(d) / steps, 2),
                       "mean_us": round(statistics.mean(d), 2), "share": round(sum(d) / total, 3) if total else 0.0,
                       **({"hlo": hlo[n]} if hlo and n in hlo else {})}
                      for n, d in names],
  }


def traced_generation(run, trace_dir: Path) -> tuple[float, list[dict], Path]:
  """Runs `run()` (a compiled generation returning an object with .seconds) under the profiler;
  returns its seconds, the device events and the trace file."""
  import jax
  with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
    seconds = run().seconds
  events, trace_file = read_trace(trace_dir)
  if trace_file is None:
    raise RuntimeError(f"the profiler wrote no perfetto_trace.json.gz under {trace_dir}")
  return seconds, events, trace_file


def read_trace(trace_dir: Path) -> tuple[list[dict], Path | None]:
  """(device events, the file) of the newest Perfetto trace the profiler wrote under trace_dir; ([], None)
  when it wrote none."""
  files = sorted(glob.glob(str(Path(trace_dir) / "**" / "perfetto_trace.json.gz"), recursive=True))
  if not files:
    return [], None
  with gzip.open(files[-1], "rt") as f:
    return device_events(json.load(f)), Path(files[-1])


def keep_command_buffers_when_traced() -> None:
  """Under a profiler session XLA runs command buffers op by op unless told otherwise, which would
  time a different program; the flag is read when the backend starts (before the first computation)."""
  flag = "--xla_enable_command_buffers_during_profiling=true"
  if flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def traced_summary(fn, steps: int, top: int = 15) -> dict:
  """`fn()` once under the profiler, summarized per step over `steps` (`summarize`); an "error" entry
  when the trace holds no device events (a CPU backend records none)."""
  import time

  import jax
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      t0 = time.perf_counter()
      fn()
      seconds = time.perf_counter() - t0
    kernels, _ = read_trace(Path(tmp))
  if not kernels:
    return {"error": "no device events (a CPU backend records none)"}
  return summarize(kernels, max(steps, 1), seconds, top)


def plot(rows: list[dict], path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  labels = [f"batch {r['batch']}" for r in rows]
  kinds = sorted({k for r in rows for k in r["by_kind"]})
  bottom = [0.0] * len(rows)
  for kind in kinds:
    vals = [r["by_kind"].get(kind, {}).get("ms_per_step", 0.0) for r in rows]
    axes[0].bar(labels, vals, bottom=bottom, label=kind)
    bottom = [b + v for b, v in zip(bottom, vals)]
  axes[0].scatter(labels, [r["untraced_wall_ms_per_step"] for r in rows], color="k", marker="_", s=900,
                  label="wall (untraced)", zorder=3)
  axes[0].scatter(labels, [r["wall_ms_per_step"] for r in rows], color="grey", marker="_", s=900,
                  label="wall (traced)", zorder=3)
  axes[0].set_ylabel("ms per decode step")
  axes[0].set_title("kernel time by kind vs wall time")
  axes[0].legend(fontsize=8)
  r0 = rows[0]
  names = [k["name"][:48] for k in r0["top_kernels"][:15]][::-1]
  axes[1].barh(names, [k["share"] for k in r0["top_kernels"][:15]][::-1])
  axes[1].set_xlabel(f"share of kernel time, {labels[0]}")
  axes[1].tick_params(axis="y", labelsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--random-shape", action="store_true", help="the model's shapes with random weights")
  ap.add_argument("--tiny", action="store_true", help="a tiny float32 model (a CPU dry run)")
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--prompt-len", type=int, default=64)
  ap.add_argument("--capacity", type=int, default=1024)
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--keep-trace", action="store_true", help="copy each raw trace beside the JSON")
  ap.add_argument("--save-hlo", action="store_true",
                  help="write each batch's compiled decode loop (HLO text, gzipped) beside the JSON")
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  keep_command_buffers_when_traced()

  import jax.numpy as jnp
  import numpy as np

  from specjax.bench.env import device_info, git_revision
  from specjax.engine.decode import decode_loop_hlo, generate_plain

  if args.tiny:
    from sharding_bench import TINY_TARGET, random_target
    target = random_target(TINY_TARGET, "tiny", dtype=jnp.float32)
  elif args.random_shape:
    from sharding_bench import SMOLLM2_SHAPES, random_target
    target = random_target(SMOLLM2_SHAPES, "SmolLM2-135M shapes (random)", dtype=jnp.dtype(args.dtype))
  else:
    from specjax.models.load import load_model
    target = load_model(args.model, dtype=jnp.dtype(args.dtype))
  cfg = target.cfg
  out_path = Path(args.out)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  out = {"experiment": "profile_decode_trace", "config": vars(args), "git_revision": git_revision(),
         "device": device_info(), "target": target.name, "rows": []}
  rng = np.random.default_rng(0)
  for b in args.batch:
    prompts = [[int(t) for t in rng.integers(1, cfg.vocab_size, args.prompt_len)] for _ in range(b)]
    run = lambda: generate_plain(target.params, cfg, prompts, max_new_tokens=args.new_tokens, capacity=args.capacity)
    run()                                                          # compilation
    untraced = min(run().seconds for _ in range(2))
    hlo_text = decode_loop_hlo(target.params, cfg, prompts, max_new_tokens=args.new_tokens, capacity=args.capacity)
    if args.save_hlo:
      with gzip.open(out_path.with_name(f"{out_path.stem}_b{b}.hlo.txt.gz"), "wt") as f:
        f.write(hlo_text)
    hlo = hlo_index(hlo_text)
    with tempfile.TemporaryDirectory() as tmp:
      seconds, kernels, trace_file = traced_generation(run, Path(tmp))
      if args.keep_trace:
        shutil.copy(trace_file, out_path.with_name(f"{out_path.stem}_b{b}.trace.json.gz"))
    row = {"batch": b, "untraced_wall_ms_per_step": round(1e3 * untraced / args.new_tokens, 4),
           "device_events": len(kernels), **summarize(kernels, args.new_tokens, seconds, args.top, hlo)}
    out["rows"].append(row)
    print(f"[trace] batch {b}: wall {row['wall_ms_per_step']:.3f} ms/step (untraced {row['untraced_wall_ms_per_step']:.3f}),"
          f" busy {row['busy_ms_per_step']:.3f}, kernels {row['kernels_per_step']}/step,"
          f" mean {row['mean_kernel_us']} us, gaps median {row['gap_us']['median']} us", flush=True)
    for kind, v in row["by_kind"].items():
      print(f"    {kind:14s} {v['per_step']:7.1f}/step {v['ms_per_step']:.4f} ms  {100 * v['share']:.1f}%")
    for k in row["top_kernels"][:12]:
      what = f"  {k['hlo']['shape']} {k['hlo']['op_name'][-60:]}" if "hlo" in k else ""
      print(f"    {k['per_step']:7.2f}/step {k['mean_us']:8.2f} us {100 * k['share']:5.1f}%  {k['name'][:60]}{what}")
    out_path.write_text(json.dumps(out, indent=1) + "\n")
  if any(r["device_events"] for r in out["rows"]):
    plot(out["rows"], out_path.with_suffix(".png"))
  else:
    print("[trace] no device events in the trace (a CPU backend records none): nothing to plot")
  return 0


if __name__ == "__main__":
  sys.exit(main())
