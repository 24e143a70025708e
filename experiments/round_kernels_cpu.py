"""Kernels of one speculative round and of its tree-specific pieces, compiled on the CPU (a guide to
where a tree round's extra work is: XLA:CPU fuses differently from XLA:GPU, so these are not GPU
kernel counts). SmolLM2's shapes with random bf16 weights and the committed DFlash drafter; counted
with `decode_flags.kernel_count` on the compiled HLO.

  python experiments/round_kernels_cpu.py --out experiments/results/round_kernels_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
sys.path.insert(0, str(ROOT))
from decode_flags import kernel_count  # noqa: E402
from sharding_bench import RANDOM_SHAPES, random_target  # noqa: E402
from specjax.bench.env import device_info, git_revision  # noqa: E402
from specjax.drafters.base import DraftParams  # noqa: E402
from specjax.drafters.dflash_tree import best_first_tree  # noqa: E402
from specjax.drafters.registry import make_speculator  # noqa: E402
from specjax.engine.generation import pad_prompts  # noqa: E402
from specjax.engine.loops import prefill_request  # noqa: E402
from specjax.engine.round import RoundInputs, RoundSpec, run_round  # noqa: E402
from specjax.engine.sampling import SamplingParams, shaped_probs  # noqa: E402
from specjax.engine.tree import (TreeDraft, accept_tree, compact_path, score_rank, tree_attention_mask,  # noqa: E402
                                 tree_positions, tree_shape)
from specjax.engine.verify import accept_drafts  # noqa: E402
from specjax.models.kv_cache import KVCache  # noqa: E402

DFLASH = str(ROOT / "assets" / "smollm2" / "dflash" / "dflash.safetensors")


def count(f, *args) -> int:
  return kernel_count(jax.jit(f).lower(*args).compile().as_text())


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  cfg = RANDOM_SHAPES["smollm2"]
  target = random_target(cfg, "smollm2 shapes (random)", dtype=jnp.bfloat16)
  b, t, d, v = 1, 32, 8, cfg.vocab_size
  rounds = {}
  for name, sp, opts, width in (("dflash chain (n_max 8)", "dflash", None, None),
                                ("dflash_tree 32 nodes", "dflash_tree", {"n_nodes": 32}, None),
                                ("dflash_tree budget 4", "dflash_tree", {"n_nodes": 32}, 4)):
    drafter = make_speculator(sp, target, head=DFLASH, options=opts,
                              draft_params=None if opts else DraftParams(n_max=8))
    k = drafter.max_draft
    dp = {n: jnp.asarray(a) for n, a in DraftParams(n_max=8 if not opts else k).arrays(
        b, None if drafter.proposes_tree else k).items()}
    inp = RoundInputs(params=target.params, dparams=drafter.params(), sampling=SamplingParams.make(b), dp=dp,
                      stop_ids=jnp.asarray([-1], jnp.int32), max_new=jnp.full((b,), 64, jnp.int32))
    spec = RoundSpec(cfg=cfg, drafter=drafter, width=width)
    tokens, lens = pad_prompts([list(range(1, 41))])
    carry = prefill_request(spec.prefill_spec(), inp, jnp.asarray(tokens), jnp.asarray(lens), capacity=512,
                            history_len=512)
    rounds[name] = count(lambda i, c, spec=spec: run_round(spec, i, c)[0], inp, carry)
    print(f"[round_kernels] {name}: {rounds[name]}", flush=True)
  cache = KVCache.init(cfg, b, 512, dtype=jnp.bfloat16)
  base, src = jnp.full((b,), 100, jnp.int32), jnp.zeros((b, d + 1), jnp.int32)
  keys = jnp.zeros((b, 2), jnp.uint32)
  tree = TreeDraft(tokens=jnp.zeros((b, t), jnp.int32), parents=jnp.full((b, t), -1, jnp.int32),
                   n_nodes=jnp.full((b,), t, jnp.int32))
  samp = SamplingParams.make(b)
  pieces = {
      "compact_path (the accepted path's K/V moved)": count(compact_path, cache, base, src),
      "shaped probs + accept_tree (32 nodes)": count(
          lambda lg, tr, s, k: accept_tree(shaped_probs(lg, s), tr, tree_shape(tr.parents, tr.n_nodes, d), k, d),
          jnp.zeros((b, t + 1, v), jnp.bfloat16), tree, samp, keys),
      "shaped probs + accept_drafts (chain of 8)": count(
          lambda lg, s, tk, ln, k: accept_drafts(shaped_probs(lg, s), tk, ln, k, None),
          jnp.zeros((b, d + 1, v), jnp.bfloat16), samp, jnp.zeros((b, d), jnp.int32), jnp.full((b,), d, jnp.int32), keys),
      "tree shape + mask + positions": count(
          lambda p, n, bs: (lambda sh: (tree_attention_mask(sh), tree_positions(bs, sh), sh.valid))(tree_shape(p, n, d)),
          tree.parents, tree.n_nodes, base),
      "log-softmax + best-first tree + ranks": count(
          lambda lp: (lambda r: (r[0], r[1], score_rank(r[2])))(best_first_tree(jax.nn.log_softmax(lp, -1), 8, 32)),
          jnp.zeros((b, d, v), jnp.float32)),
  }
  for k_, n in pieces.items():
    print(f"[round_kernels] {k_}: {n}", flush=True)
  out = {"experiment": "round_kernels_cpu", "git_revision": git_revision(), "device": device_info(),
         "config": {"shape": "smollm2 (random bf16)", "batch": b, "tree_nodes": t, "depth": d, "capacity": 512},
         "rounds": rounds, "pieces": pieces}
  Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
