"""One tree verification round vs one chain round of the same number of tokens (issue 8, item 4).

  python experiments/bench_tree_round.py --out $OUT/tree_round.json      # see experiments/gpu_tree.sh

A round is the engine's whole verification step on a prefilled GenState: target forward over
[last, T draft tokens] (tree: depth positions + ancestor mask), shaping p, acceptance, KV rollback
(tree: compaction of the accepted path into consecutive slots), emission. Trees are random
(node i's parent uniform in {root, 0..i-1}) with random tokens; the chain has K = T draft tokens.
`tree_q` is the tree round with proper draft distributions q [B, T, V] (the sequential
recursive-rejection pass over the nodes) at temperature 0.7; `tree` and `chain` run greedy
(one-hot candidates: all nodes accepted / rejected at once).

Each timed call runs --rounds rounds inside one jitted fori_loop (state carried and donated, the
cache lengths / history reset after each round so every round verifies from the same context),
so the numbers are device time per round, dispatch amortized. Median of --repeats calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.bench.env import device_info, git_revision  # noqa: E402
from specjax.drafters.base import Draft  # noqa: E402
from specjax.engine import verify_and_accept, verify_tree_and_accept  # noqa: E402
from specjax.decode import prefill_jit  # noqa: E402
from specjax.sampling import SamplingParams  # noqa: E402
from specjax.tree import TreeDraft  # noqa: E402


def random_tree(rng, batch: int, t: int, vocab: int, with_q: bool):
  """Random recursive trees (parent of node i uniform in {-1, 0..i-1}), random tokens; with_q: q =
  softmax of random logits with each node's token drawn from it."""
  parents = np.stack([[rng.integers(-1, i) for i in range(t)] for _ in range(batch)]).astype(np.int32)
  depth = np.zeros((batch, t), np.int32)
  for i in range(t):
    depth[:, i] = np.where(parents[:, i] < 0, 1, depth[np.arange(batch), np.maximum(parents[:, i], 0)] + 1)
  q = None
  if with_q:
    logits = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (batch, t, vocab), jnp.float32) * 3.0
    q = jax.nn.softmax(logits, axis=-1)
    tokens = jax.random.categorical(jax.random.key(int(rng.integers(1 << 30))), logits).astype(jnp.int32)
  else:
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, t)), jnp.int32)
  tree = TreeDraft(tokens=tokens, parents=jnp.asarray(parents), n_nodes=jnp.full((batch,), t, jnp.int32), q=q)
  return tree, int(depth.max())


@functools.partial(jax.jit, static_argnames=("cfg", "kind", "max_depth", "rounds"), donate_argnames=("state",))
def run_rounds(params, state, draft, sampling, *, cfg, kind, max_depth, rounds):
  b = state.last.shape[0]
  width = draft.tokens.shape[1]
  dp = {"n_max": jnp.full((b,), width, jnp.int32), "n_min": jnp.zeros((b,), jnp.int32),
        "p_min": jnp.zeros((b,), jnp.float32)}
  stop, max_new = jnp.asarray([-1], jnp.int32), jnp.full((b,), 1 << 30, jnp.int32)
  base_len, base_hist, base_last = state.cache.lengths, state.hist_len, state.last

  def body(_, s):
    if kind == "chain":
      s = verify_and_accept(params, cfg, s, draft, dp, sampling, stop, max_new)[0]
    else:
      s = verify_tree_and_accept(params, cfg, s, draft, dp, sampling, stop, max_new, max_depth)[0]
    return dataclasses.replace(s, cache=s.cache.with_lengths(base_len), hist_len=base_hist, last=base_last)

  return jax.lax.fori_loop(0, rounds, body, state)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="smollm2-135m-instruct")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 32, 64])
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  ap.add_argument("--q-nodes", type=int, nargs="*", default=[16, 64], help="T values also timed with proper q")
  ap.add_argument("--context", type=int, default=512, help="prompt tokens before the round")
  ap.add_argument("--rounds", type=int, default=20)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting new configurations after this")
  ap.add_argument("--out", required=True)
  args = ap.parse_args(argv)
  t_start = time.perf_counter()
  from specjax.models.load import load_model
  model = load_model(args.model, dtype=jnp.dtype(args.dtype), with_tokenizer=False, progress=False)
  cfg, params = model.cfg, model.params
  rng = np.random.default_rng(0)
  rows = []
  cap = args.context + max(args.nodes + args.q_nodes) + 64
  prompts = {b: jnp.asarray(rng.integers(0, cfg.vocab_size, (b, args.context)), jnp.int32) for b in args.batch}
  # Most important first (the budget may cut the tail): chain vs tree at every T and batch, then tree_q.
  configs = [(kind, b, t) for t in args.nodes for b in args.batch for kind in ("chain", "tree")]
  configs += [("tree_q", b, t) for t in args.q_nodes for b in args.batch]
  for kind, b, t in configs:
    if time.perf_counter() - t_start > args.budget_s:
      print(f"budget reached: skipping b={b} T={t} {kind}", flush=True)
      continue
    temp = 0.7 if kind == "tree_q" else 0.0
    sampling = SamplingParams.make(b, temperature=temp, seed=1)
    if kind == "chain":
      draft, depth = Draft(tokens=jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32),
                           lengths=jnp.full((b,), t, jnp.int32)), t
    else:
      draft, depth = random_tree(rng, b, t, cfg.vocab_size, kind == "tree_q")
    state = prefill_jit(params, prompts[b], jnp.full((b,), args.context, jnp.int32), sampling,
                        jnp.asarray([-1], jnp.int32), jnp.full((b,), 1 << 30, jnp.int32), cfg=cfg,
                        capacity=cap, history_len=cap)
    fn = functools.partial(run_rounds, cfg=cfg, kind=kind, max_depth=t, rounds=args.rounds)
    t0 = time.perf_counter()
    state = jax.block_until_ready(fn(params, state, draft, sampling))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      state = jax.block_until_ready(fn(params, state, draft, sampling))
      times.append((time.perf_counter() - t0) / args.rounds * 1e3)
    row = {"kind": kind, "batch": b, "nodes": t, "verified_tokens": t + 1, "tree_depth": depth,
           "ms_per_round": statistics.median(times), "ms_min": min(times), "first_call_s": compile_s}
    rows.append(row)
    print(json.dumps(row), flush=True)
  print(f"{'kind':7s} {'B':>3s} {'T':>3s} {'depth':>5s} {'ms/round':>9s}  vs chain")
  chain = {(r["batch"], r["nodes"]): r["ms_per_round"] for r in rows if r["kind"] == "chain"}
  for r in rows:
    ref = chain.get((r["batch"], r["nodes"]))
    r["vs_chain"] = r["ms_per_round"] / ref if ref else None
    print(f"{r['kind']:7s} {r['batch']:3d} {r['nodes']:3d} {r['tree_depth']:5d} {r['ms_per_round']:9.3f}  "
          + (f"{r['vs_chain']:.2f}x" if ref else "-"))
  out = {"experiment": "tree_round", "config": vars(args), "model": args.model, "git_revision": git_revision(),
         "device": device_info(), "results": rows, "seconds": time.perf_counter() - t_start}
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
