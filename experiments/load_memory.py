"""Peak host and device memory of loading a checkpoint (issue 23, item 3).

Writes (once) an HF checkpoint folder of random weights with the shapes of a named model
(`llama-8b`: Llama-3.1-8B, bf16, 4.9 GB shards; `small`: a 0.3 GB float32 Llama for a CPU check),
then loads it with `specjax.models.load.load_model` in a fresh child process per mode and records:

- `host_peak_gb`: the child's peak resident set (ru_maxrss) less its resident set just before the
  load (jax imported, the device initialised), i.e. what the load added at its peak;
- `device_peak_gb`: the device's peak bytes in use (`memory_stats`, GPU) less the bytes in use
  before the load; on the CPU the parameters live in host memory and are counted by the first;
- `model_gb`: the parameters' bytes in the load dtype; `largest_tensor_gb`; `seconds`.

Modes: `stream` (load_model as is: each tensor read, converted and moved to the device before the
next is read) and `eager` (every tensor read into float32 host arrays first, then the same fill:
what loading did before it streamed). Random values do not change memory or time, so the writer
tiles one random block (fast to write).

  python experiments/load_memory.py --shape llama-8b --dir /tmp/llama8b --out $OUT/load_memory_llama8b.json
  python experiments/load_memory.py --shape small --dir /tmp/small --out /tmp/load_memory_small.json   # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {   # HF config fields; dtype of the written tensors
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                     rope_theta=500000.0, max_position_embeddings=131072, dtype="bfloat16",
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "small": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=64, vocab_size=8192, tie_word_embeddings=False,
                  rope_theta=10000.0, max_position_embeddings=2048, dtype="float32"),
}
SHARD_BYTES = 4_900_000_000


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
  """HF tensor name -> shape ([out, in]) of a Llama checkpoint with config `c`."""
  d, f, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
  q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
  out = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,)}
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f)})
  if not c["tie_word_embeddings"]:
    out["lm_head.weight"] = (c["vocab_size"], d)
  return out


def write_checkpoint(shape: str, folder: Path) -> None:
  """config.json + model-0000k.safetensors shards of random values (one random block tiled)."""
  import numpy as np
  import ml_dtypes
  from safetensors.numpy import save_file
  from tqdm.auto import tqdm
  c = dict(SHAPES[shape])
  dtype = ml_dtypes.bfloat16 if c["dtype"] == "bfloat16" else np.float32
  folder.mkdir(parents=True, exist_ok=True)
  block = (np.random.default_rng(0).standard_normal(1 << 20) * 0.02).astype(dtype)
  shard, size, k = {}, 0, 0
  shapes = tensor_shapes(c)
  for name, shp in tqdm(shapes.items(), desc=f"write {shape}", unit="tensor"):
    n = int(np.prod(shp))
    arr = np.resize(block, n).reshape(shp) if not name.endswith("norm.weight") else np.ones(shp, dtype)
    shard[name] = arr
    size += arr.nbytes
    if size >= SHARD_BYTES:
      save_file(shard, str(folder / f"model-{k:05d}.safetensors"))
      shard, size, k = {}, 0, k + 1
  if shard:
    save_file(shard, str(folder / f"model-{k:05d}.safetensors"))
  cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
         "torch_dtype": c["dtype"], **{k: v for k, v in c.items() if k != "dtype"}}
  (folder / "config.json").write_text(json.dumps(cfg, indent=1))


def _rss_gb() -> float:
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmRSS:"):
      return int(line.split()[1]) / 1e6
  return float("nan")


def _device_in_use() -> tuple[float, float]:
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_in_use", 0) / 1e9, stats.get("peak_bytes_in_use", 0) / 1e9


def child(folder: str, mode: str, dtype: str) -> dict:
  """One load in this (fresh) process; returns its measurements."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  jax.devices()
  jnp.zeros(1).block_until_ready()                       # the device is initialised before the baseline
  from specjax.bench.env import device_info, git_revision
  from specjax.models import load as load_mod
  from specjax.io import safetensors as st
  if mode == "eager":                                    # every tensor in float32 on the host first
    real = st.load_safetensors_dir

    def eager(path):
      hf, tensors = real(path)
      return hf, {n: np.asarray(tensors[n], np.float32) for n in tensors}
    st.load_safetensors_dir = eager
  rss0, (dev0, _) = _rss_gb(), _device_in_use()
  t0 = time.perf_counter()
  model = load_mod.load_model(folder, dtype=getattr(jnp, dtype), with_tokenizer=False, progress=False)
  jax.block_until_ready(model.params)
  seconds = time.perf_counter() - t0
  peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6          # kB -> GB
  _, dev_peak = _device_in_use()
  leaves = jax.tree_util.tree_leaves(model.params)
  return {"mode": mode, "dtype": dtype, "seconds": round(seconds, 2),
          "host_baseline_gb": round(rss0, 3), "host_peak_gb": round(peak_rss - rss0, 3),
          "device_peak_gb": round(dev_peak - dev0, 3) if dev_peak else None,
          "model_gb": round(sum(x.nbytes for x in leaves) / 1e9, 3),
          "largest_tensor_gb": round(max(x.nbytes for x in leaves) / 1e9, 3),
          "device": device_info(), "git_revision": git_revision()}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
  ap.add_argument("--dir", required=True, help="checkpoint folder (written if it has no config.json)")
  ap.add_argument("--dtype", default=None, help="load dtype (default: the checkpoint's)")
  ap.add_argument("--modes", default="stream,eager")
  ap.add_argument("--out", required=True)
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  dtype = args.dtype or SHAPES[args.shape]["dtype"]
  if args.child:
    print("RESULT " + json.dumps(child(args.dir, args.child, dtype)))
    return
  folder = Path(args.dir)
  if not (folder / "config.json").exists():
    t0 = time.perf_counter()
    write_checkpoint(args.shape, folder)
    print(f"wrote {folder} in {time.perf_counter() - t0:.0f} s")
  rows = []                           # jax stays out of this process: each child has the device alone
  for mode in args.modes.split(","):
    proc = subprocess.run([sys.executable, __file__, "--shape", args.shape, "--dir", str(folder), "--dtype", dtype,
                           "--out", args.out, "--child", mode], capture_output=True, text=True, env=os.environ)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
      rows.append({"mode": mode, "error": proc.stderr[-2000:]})
    else:
      rows.append(json.loads(line[len("RESULT "):]))
    print(json.dumps(rows[-1]), flush=True)
    write_result(args, folder, rows)                 # after every mode: a run cut short keeps its rows
  print(f"-> {args.out}")


def write_result(args, folder: Path, rows: list[dict]) -> None:
  files = sorted(folder.glob("*.safetensors"))
  result = {"question": "peak host / device memory of loading a checkpoint", "shape": args.shape,
            "config": SHAPES[args.shape], "checkpoint_gb": round(sum(f.stat().st_size for f in files) / 1e9, 3),
            "shards": len(files), "git_revision": None, "device": None,
            "rows": [{k: v for k, v in r.items() if k not in ("git_revision", "device")} for r in rows]}
  for key in ("git_revision", "device"):
    result[key] = next((r[key] for r in rows if key in r), None)
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
