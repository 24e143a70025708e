"""What XLA's GPU options do to a plain decode step: kernels per layer and ms per step, per option set.

A batch-1 decode step of SmolLM2-135M is bound by kernel launches, not by its 270 MB of weights
(~1 ms against a ~0.08 ms bandwidth floor on an H100; experiments/README, "How fast is plain
decoding?"), so what counts is how many kernels XLA makes of a layer. For each variant (a named set
of XLA flags, --variants; VARIANTS lists them; a few also patch the model's code, PATCHES, or set
environment variables, VARIANT_ENV) a child process started with those flags in XLA_FLAGS (they are
read once, when the backend starts):

- compiles one plain decode step (`parallel.hlo.decode_step_hlo` on a one-device mesh: the engine's
  `decode_step`, as the decode loop runs it) of the target cut to 1 and to 2 layers and counts the
  kernels of each compiled program (`kernel_count`: the instructions that launch work, outside fused
  computations; command-buffer and other called computations are counted through), so kernels
  per layer = 2 layers - 1 layer, the rest is the step's own (embedding, LM head, sampling, emit);
- times plain generation (`generate_plain`) at each --batch for --new-tokens and for twice as many
  tokens, median of --repeats each: ms per decode step = the difference over the extra tokens, so
  prefill and the call's fixed cost drop out.
- with --verify-tokens T..., times a T-token forward (what a chain verification of T - 1 drafts, or
  a tree of T nodes, runs through the target) at each --batch over --context committed slots, in a
  device loop of --new-tokens and twice as many iterations (`verify_row`): what a variant does to
  verification rounds beside decode steps.

The target: SmolLM2-135M-Instruct's weights (--model, fetched), or its shapes with random weights
(--random-shape: no download; speed does not depend on the values), or a tiny float32 model on the
CPU (--tiny: a dry run of the script). One JSON (config, git revision, device, a row per variant and
batch) and a printed table.

  python experiments/decode_flags.py --random-shape --out $OUT/decode_flags.json            # GPU
  python experiments/decode_flags.py --variants default triton_gemm_any --out $OUT/f.json
  python experiments/decode_flags.py --tiny --variants default --batch 1 --new-tokens 4 --out /tmp/f.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name -> XLA flags added to the environment's XLA_FLAGS (GPU options; the CPU backend parses them too)
VARIANTS = {
    "default": "",
    # every GEMM through Triton, which can fuse the elementwise work around it (norm scale, residual)
    "triton_gemm_any": "--xla_gpu_triton_gemm_any=true",
    # cuBLASLt GEMMs, whose epilogues take bias / activation
    "cublaslt": "--xla_gpu_enable_cublaslt=true",
    # dynamic-slice / update-slice work (the KV-cache write) fused with its neighbours
    "dynamic_slice_fusion": "--xla_gpu_enable_dynamic_slice_fusion=true",
    # the step's kernels captured in CUDA graphs however few there are in a run
    "graph_min_1": "--xla_gpu_graph_min_graph_size=1",
    # XLA's defaults, with every one-row product run as a two-row GEMM (`two_row_products`), or none
    # (`one_row_products`; the model's default does so for wide matrices only, `layers.row_product`)
    "two_row_products": "",
    "one_row_products": "",
    # every weight stored [in, out] (the model's layout before [out, in]) and multiplied against
    # that layout (`in_out_products`)
    "in_out_products": "",
    # the greedy token as a bare argmax, no conditional between it and the sampled draw (`greedy_argmax`)
    "greedy_argmax": "",
    # a batch-1 KV-cache write as the scatter that drops slots past the capacity (`scatter_cache_write`:
    # the model's write before batch 1 took a slice update; its out-of-range select is a kernel)
    "scatter_cache_write": "",
    # RMSNorm's 1 / rms applied to its projection's output, the weight to its input
    # (`norm_after_projection`: the normed activation not a kernel of its own)
    "norm_after_projection": "",
    # one-token attention as one pass per KV head, no split partials to merge (`single_pass_decode_attention`)
    "single_pass_decode_attention": "",
    # every step's attention (verification too) as one pass, nothing to merge (`single_pass_attention`)
    "single_pass_attention": "",
    # one-token decode attention through XLA instead of the Pallas kernel (no padded query, no
    # split-combine; `VARIANT_ENV`)
    "xla_decode_attention": "",
    # the command buffers off: every kernel launched on its own (what graphs buy)
    "no_command_buffer": "--xla_gpu_enable_command_buffer=",
    # XLA's defaults, every layer of a decode step through the fused Pallas kernels (`VARIANT_ENV`;
    # their tilings from SPECJAX_FUSED_TILINGS or the packaged table, as the engine reads them)
    "fused_layers": "",
    # the fused layers with custom calls (the Pallas kernels) in the command buffers, and with the
    # loop itself captured too
    "fused_cmdbuf": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
    "fused_cmdbuf_while": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    # the decode loop itself in a command buffer with its body unrolled into the graph, graphs of any size
    "cmdbuf_while_unroll": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
                           " --xla_gpu_command_buffer_unroll_loops=true --xla_gpu_graph_min_graph_size=1",
    # programmatic dependent launch off (Hopper: a kernel's prologue overlaps its predecessor's tail
    # where XLA's emitters allow it; what it buys a chain of small kernels)
    "no_pdl": "--xla_gpu_enable_pdl=false",
}

# variants that set environment variables in the child: name -> {variable: value}
VARIANT_ENV = {name: {"SPECJAX_FUSED_DECODE": "1"} for name in ("fused_layers", "fused_cmdbuf", "fused_cmdbuf_while")}
VARIANT_ENV["xla_decode_attention"] = {"SPECJAX_VERIFY_ATTENTION_DECODE": "0"}

def two_row_products() -> None:
  """Every one-row product (a batch-1 decode step) as a two-row GEMM, in this child process only:
  `layers.row_product`'s size threshold set to 0 (the model's default runs only wide matrices so).
  Values unchanged (the zero row is dropped)."""
  from specjax.models import layers
  layers.TWO_ROW_MIN_ELEMENTS = 0


def one_row_products() -> None:
  """Every one-row product as XLA's own one-row product (the threshold out of reach): the model
  before `layers.row_product`."""
  from specjax.models import layers
  layers.TWO_ROW_MIN_ELEMENTS = 1 << 62


def in_out_products() -> None:
  """Every linear layer's weight stored as [in, out] (an untied LM head's too) and its product
  taken against that layout, in this child process only: the model's layout before [out, in],
  where XLA wrote a one-row product's whole float32 product before reducing it for most
  projections. The two-row rule (`layers.row_product`) is kept. Random weights are drawn as usual
  and transposed at construction; values unchanged."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from specjax.models import decoder, layers
  init, head = layers.Linear.__init__, decoder.Transformer.head

  def init_t(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.kernel = nnx.Param(self.kernel[...].T)                                            # [in, out]

  def call_t(self, x):
    w = self.kernel[...]
    if int(np.prod(x.shape[:-1])) != 1 or w.size < layers.TWO_ROW_MIN_ELEMENTS:
      y = jnp.einsum("...i,io->...o", x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    else:
      rows = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)]).astype(w.dtype)
      y = jnp.einsum("mi,io->mo", jax.lax.optimization_barrier(rows), w, preferred_element_type=jnp.float32)
      y = jax.lax.optimization_barrier(y)[0].reshape(*x.shape[:-1], w.shape[-1])
    return y if self.bias is None else y + self.bias[...].astype(jnp.float32)

  def head_t(self, h):
    if self.lm_head is None or self.cfg.invariant:
      return head(self, h)
    w = self.lm_head.kernel[...]                                                            # [d, V]
    return jnp.einsum("btd,dv->btv", h.astype(w.dtype), w, preferred_element_type=jnp.float32)
  layers.Linear.__init__, layers.Linear.__call__, decoder.Transformer.head = init_t, call_t, head_t


def greedy_argmax() -> None:
  """Every sampled token as the logits' argmax alone, in this process only (every row of the
  benchmarks that use it is greedy): the callers of `sampling.next_token` (the engine's decode step
  and prefill, the server's prefill and plain rounds) lose the `lax.cond` between the argmax and
  the sampled draw, so that conditional's cost (a predicate read, or a graph node) shows against
  `default`."""
  import jax.numpy as jnp

  from specjax.engine import decode, generation
  from specjax.serve import slot_programs

  def argmax(logits, params, keys):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  for module in (decode, generation, slot_programs):
    module.next_token = argmax


def scatter_cache_write() -> None:
  """A batch-1 KV-cache write as the per-row scatter that drops slots past the capacity, in this
  child process only: the model's write before batch 1 took a `dynamic_update_slice`. XLA turns
  that scatter into a slice update behind a select of the old slots where a slot is out of range,
  a kernel of its own per layer (and the range check another). Same values within the capacity."""
  from specjax.models import kv_cache

  def write(self, layer, k_new, v_new):
    return (kv_cache.scatter_rows(self.k[layer], k_new, self.lengths),
            kv_cache.scatter_rows(self.v[layer], v_new, self.lengths))
  kv_cache.KVCache.write = write


def norm_after_projection() -> None:
  """Each pre-attention and pre-MLP RMSNorm applied around its projection instead of before it,
  in this child process only: the projection takes x * weight (an elementwise producer XLA can
  fuse into the product's input) and its output is scaled by the row's 1 / rms (an epilogue the
  consumers fuse), so the normed activation is never its own kernel. Equal in exact arithmetic
  (norm(x) @ W = rsqrt(mean x^2) * ((x * w) @ W)); in bf16 the product's input is rounded before
  the 1 / rms factor instead of after it. Blocks with sandwich norms, QK norms or the invariant
  kernels keep the model's code."""
  import jax
  import jax.numpy as jnp

  from specjax.kernels import verify_attention
  from specjax.models import decoder, layers
  block_call = decoder.Block.__call__

  def prescaled(norm, x):                                  # (x * w [B, T, d] in x's dtype, 1 / rms [B, T, 1] f32)
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + norm.eps)
    w = norm.weight[...].astype(jnp.float32)
    return (xf * (1.0 + w if norm.offset else w)).astype(x.dtype), r

  def attend(attn, xw, r, positions, write_kv, mask, ragged):
    b, t, _ = xw.shape
    qkv = attn.qkv_proj(xw) * r                                                   # [B, T, (H+2KVH)*D]
    q, k, v = layers.split_qkv(qkv, attn.n_heads, attn.n_kv_heads, attn.head_dim)
    q, k = layers.rope(q, positions, attn.theta, attn.rope_scaling), layers.rope(k, positions, attn.theta,
                                                                                 attn.rope_scaling)
    k_all, v_all = write_kv(k, v)
    out = verify_attention.attention(q, k_all, v_all, mask, attn.scale, ragged)
    return attn.o_proj(out.reshape(b, t, -1)), (k_all, v_all)

  def call(self, x, positions, write_kv, masks):
    if self.invariant or self.sandwich or self.self_attn.q_norm is not None:
      return block_call(self, x, positions, write_kv, masks)
    kind = "sliding" if self.sliding else "full"
    xw, r = prescaled(self.input_layernorm, x)
    attn_out, kv = attend(self.self_attn, xw, r, positions, write_kv, masks[kind],
                          masks.get("ragged", {}).get(kind))
    x = x + attn_out
    xw, r = prescaled(self.post_attention_layernorm, x)
    g, u = layers.split_gate_up(self.mlp.gate_up_proj(xw) * r)
    g = jax.nn.silu(g) if self.mlp.activation == "silu" else jax.nn.gelu(g, approximate=True)
    return x + self.mlp.down_proj(g * u), kv
  decoder.Block.__call__ = call


def single_pass_attention(max_tokens: int | None = None) -> None:
  """Attention of steps of at most `max_tokens` new tokens (every step: None) as a single pass per
  (sequence, KV head, row block), in this child process only: the kernel's tiling with no split of
  the committed slots (`Tiling.n_splits` 0) and 128-slot blocks where the accumulator allows, so no
  partials are merged after it (the three merge kernels of a split step go) at the cost of one
  program walking the whole context. Values: the same attention, summed in another order."""
  import dataclasses

  from specjax.kernels import verify_attention as va
  tiling_for = va.tiling_for

  def one_pass(b, t, h, kvh, d, capacity, sm_count=None):
    tl = tiling_for(b, t, h, kvh, d, capacity, sm_count)
    if tl is None or (max_tokens is not None and t > max_tokens):
      return tl
    return dataclasses.replace(tl, block_k=64 if tl.block_m * d >= 8192 else 128, n_splits=0)
  va.tiling_for = one_pass


# variants that change the model's code as well as the flags: name -> patch, applied in the child
PATCHES = {"two_row_products": two_row_products, "one_row_products": one_row_products,
           "in_out_products": in_out_products, "greedy_argmax": greedy_argmax,
           "scatter_cache_write": scatter_cache_write,
           "norm_after_projection": norm_after_projection,
           "single_pass_decode_attention": lambda: single_pass_attention(max_tokens=1),
           "single_pass_attention": single_pass_attention}

# instructions that launch no kernel of their own
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
         "partition-id", "replica-id", "add-dependency", "domain", "copy-done", "all-reduce-done",
         "all-gather-done", "collective-permute-done", "async-done", "send-done", "recv-done"}
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\((.*)$")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?")


def kernel_count(hlo_text: str) -> int:
  """The kernels a compiled program launches per run, from its HLO text: every instruction of the
  entry computation and of the computations it calls (while bodies, conditionals, command-buffer
  calls), whose opcode launches work (`fusion`, `custom-call`: GEMMs, Pallas kernels; `copy`,
  collectives, ...), not inside fused computations (a fusion is one kernel) nor the reducers of
  reductions. While bodies count once (one iteration), a conditional as its largest branch plus
  the predicate's read."""
  comps: dict[str, list[tuple[str, str]]] = {}
  entry, cur = None, None
  for line in hlo_text.splitlines():
    m = _COMP.match(line)
    if m and not line.startswith(" "):
      cur = m.group(1)
      comps[cur] = []
      if line.startswith("ENTRY"):
        entry = cur
      continue
    i = _INSTR.match(line)
    if i and cur is not None:
      comps[cur].append((i.group(1), i.group(2)))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")

  def count(name: str, seen: frozenset) -> int:
    n = 0
    for op, rest in comps.get(name, []):
      if op in _FREE:
        continue
      if op in ("call", "while", "conditional", "async-start"):
        called = [c for m in _CALLS.finditer(rest) for c in re.split(r",\s*%?", m.group(1))
                  if c in comps and c not in seen]
        counts = [count(c, seen | {c}) for c in called]
        # a conditional runs one branch (the largest counted); a while runs its condition and body
        n += (max(counts, default=0) if op == "conditional" else sum(counts)) + (op == "conditional")
        continue
      n += 1
    return n
  return count(entry, frozenset({entry}))


def child(args) -> dict:
  """One variant, in this process (XLA_FLAGS already set, a model patch applied here): kernels per
  step and layer, ms per step."""
  if args.one in PATCHES:
    PATCHES[args.one]()
  import jax
  import jax.numpy as jnp
  import numpy as np

  from specjax.bench.env import device_info
  from specjax.engine.decode import generate_plain
  from specjax.parallel import make_mesh
  from specjax.parallel.hlo import decode_step_hlo

  if args.tiny:
    from sharding_bench import TINY_TARGET, random_target
    target, dtype = random_target(TINY_TARGET, "tiny", dtype=jnp.float32), jnp.float32
  elif args.random_shape:
    from sharding_bench import RANDOM_SHAPES, random_target
    dtype = jnp.dtype(args.dtype)
    target = random_target(RANDOM_SHAPES[args.shape], f"{args.shape} shapes (random)", dtype=dtype)
  else:
    from specjax.models.load import load_model
    dtype = jnp.dtype(args.dtype)
    target = load_model(args.model, dtype=dtype)
  cfg = target.cfg
  mesh = make_mesh("data=1,model=1", jax.devices()[:1])
  kernels = {n: kernel_count(decode_step_hlo(cfg.replace(n_layers=n), mesh, 1, capacity=args.capacity, dtype=dtype))
             for n in (1, 2)}
  per_layer = kernels[2] - kernels[1]
  rng = np.random.default_rng(0)
  rows = []
  for b in args.batch:
    prompts = [[int(t) for t in rng.integers(1, cfg.vocab_size, args.prompt_len)] for _ in range(b)]
    times = {}
    for n in (args.new_tokens, 2 * args.new_tokens):
      run = lambda: generate_plain(target.params, cfg, prompts, max_new_tokens=n, capacity=args.capacity)
      run()                                                   # compilation
      times[n] = statistics.median(run().seconds for _ in range(args.repeats))
    ms = 1e3 * (times[2 * args.new_tokens] - times[args.new_tokens]) / args.new_tokens
    rows.append({"batch": b, "ms_per_step": round(ms, 4), "tokens_per_s_steps": round(1e3 * b / ms, 1),
                 "seconds": {str(k): round(v, 5) for k, v in times.items()}})
  verify = [verify_row(target, cfg, b, t, args, dtype, rng) for t in args.verify_tokens for b in args.batch]
  return {"kernels_per_layer": per_layer, "kernels_outside_layers": kernels[1] - per_layer,
          "kernels_per_step": kernels[1] + (cfg.n_layers - 1) * per_layer, "n_layers": cfg.n_layers,
          "rows": rows, "verify_rows": verify, "device": device_info(), "target": target.name, "cfg": repr(cfg)}


def verify_row(target, cfg, batch: int, t: int, args, dtype, rng) -> dict:
  """ms of one T-token forward (a chain verification's, or a decode step's at T = 1) inside a
  device loop: the target's `verify` of the same T random tokens over a cache of --context
  committed slots, repeated with the lengths held (every iteration writes the same slots and sees
  the same context), its logits' argmax summed so the LM head is not optimized away. Timed at
  --new-tokens and twice as many iterations: the difference per iteration is the forward alone
  (no dispatch, no prefill)."""
  import jax
  import jax.numpy as jnp

  from specjax.bench.timing import time_call
  from specjax.engine.generation import target_of
  from specjax.models.kv_cache import KVCache
  runner = target_of(cfg)
  tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (batch, t)), jnp.int32)
  cache = KVCache.init(cfg, batch, args.capacity, dtype).with_lengths(jnp.full((batch,), args.context, jnp.int32))

  def loop(n):
    def body(_, carry):
      c, acc = carry
      logits, _, after, _ = runner.verify(target.params, cfg, tokens, c)
      return after.with_lengths(c.lengths), acc + jnp.sum(jnp.argmax(logits, axis=-1))
    return jax.jit(lambda c: jax.lax.fori_loop(0, n, body, (c, jnp.int32(0)))[1])

  times = {n: time_call(loop(n), (cache,), args.repeats, iters=1)               # ms a call, median
           for n in (args.new_tokens, 2 * args.new_tokens)}
  ms = (times[2 * args.new_tokens] - times[args.new_tokens]) / args.new_tokens
  return {"batch": batch, "tokens": t, "context": args.context, "ms_per_forward": round(ms, 4),
          "seconds": {str(k): round(v / 1e3, 5) for k, v in times.items()}}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--random-shape", action="store_true", help="a model's shapes with random weights (--shape)")
  from sharding_bench import RANDOM_SHAPES
  ap.add_argument("--shape", default="smollm2", choices=sorted(RANDOM_SHAPES),
                  help="whose shapes --random-shape takes (default smollm2)")
  ap.add_argument("--tiny", action="store_true", help="a tiny float32 model (a CPU dry run)")
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  ap.add_argument("--new-tokens", type=int, default=128, help="timed at this many and twice as many")
  ap.add_argument("--prompt-len", type=int, default=64)
  ap.add_argument("--capacity", type=int, default=1024)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--verify-tokens", type=int, nargs="*", default=[],
                  help="also time a T-token forward (chain verification) in a device loop for each T, at each --batch")
  ap.add_argument("--context", type=int, default=256, help="committed slots the --verify-tokens forwards attend to")
  ap.add_argument("--out", required=True)
  ap.add_argument("--one", default=None, help=argparse.SUPPRESS)        # the child's variant
  args = ap.parse_args(argv)
  if "in_out_products" in args.variants and not (args.random_shape or args.tiny):
    ap.error("in_out_products builds its model with random weights only: add --random-shape (or --tiny)")
  if args.one is not None:
    print("DECODE_FLAGS " + json.dumps(child(args)), flush=True)
    return 0

  from specjax.bench.env import git_revision
  out = {"experiment": "decode_flags", "config": vars(args), "git_revision": git_revision(),
         "variants": {k: VARIANTS[k] for k in args.variants}, "results": {}}
  passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
  for name in args.variants:
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + VARIANTS[name]).strip(),
           **VARIANT_ENV.get(name, {})}
    r = subprocess.run([sys.executable, __file__, *passthrough, "--one", name], env=env, capture_output=True,
                       text=True)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("DECODE_FLAGS ")), None)
    if r.returncode != 0 or line is None:
      out["results"][name] = {"error": (r.stderr or r.stdout)[-1500:]}
      print(f"[decode_flags] {name}: failed\n{(r.stderr or r.stdout)[-1500:]}", flush=True)
    else:
      got = json.loads(line[len("DECODE_FLAGS "):])
      out["results"][name] = got
      out["device"] = got["device"]
      steps = "  ".join(f"b{row['batch']} {row['ms_per_step']:.3f} ms" for row in got["rows"])
      print(f"[decode_flags] {name:22s} kernels/layer {got['kernels_per_layer']:3d}  outside {got['kernels_outside_layers']:3d}"
            f"  step {got['kernels_per_step']:4d}  {steps}", flush=True)
      for row in got["verify_rows"]:
        print(f"[decode_flags] {name:22s} b{row['batch']} T={row['tokens']:<3d} forward {row['ms_per_forward']:.3f} ms",
              flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
