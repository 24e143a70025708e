"""Why a DFlash drafter's training metrics (tau_est, acc by block slot) and its tau at inference differ.

On the CPU in float32 with the real SmolLM2 weights: for each prompt set, the target's greedy answers
(plain decoding); on those token rows
  - `teacher_forced`: the training forward (`specjax.train.dflash.anchor_blocks`) with an anchor at
    every answer position: top-1 hit rate per block slot against the target's argmax (what the
    training metrics acc_01.. measure) and `tau_uniform` = 1 + accepted prefix averaged over all
    anchors (what the training metric tau_est measures);
  - `tau_replayed`: the engine's rounds replayed from those blocks (a round at anchor a accepts the
    longest hit prefix n <= n_max, the next round starts at a + n + 1);
  - with --engine: `speculative_generate` with the drafter (greedy, n_max 15) on the same prompts:
    tau, acceptance by position, rounds per sequence (equal to the replayed ones when drafting and
    training agree) and whether its output equals plain decoding's.
Sets: MT-bench first turns, HumanEval 1-N (held out of the first drafter's training) and 17.. (trained
on), GSM8K prompts of the first drafter's training stream and past it, Alpaca (trained on).

  python experiments/dflash_gap.py --head assets/smollm2/dflash --out experiments/results/dflash_gap_cpu.json
(results/dflash_gap_cpu.json came from assets/dflash_smollm2: head removed from the tree; it is in
revision 7b949ed)
"""

from __future__ import annotations

import argparse
import json
import time

import jax.numpy as jnp
import numpy as np


def prompt_texts(name: str, n: int) -> list[str]:
  from specjax.bench.prompts import load_prompt_set
  if name.startswith("gsm8k"):   # the first drafter's data: source 2 of its stream, shuffled with seed 0 + 2
    qs = load_prompt_set("gsm8k")
    order = np.random.default_rng(2).permutation(len(qs))
    start = 0 if name == "gsm8k_trained" else 7400   # its 7198 rows held ~6458 GSM8K prompts
    return [qs[j].turns[0] for j in order[start:start + n]]
  if name == "humaneval_heldout":
    return [q.turns[0] for q in load_prompt_set("humaneval")[:n]]
  if name == "humaneval_trained":
    return [q.turns[0] for q in load_prompt_set("humaneval")[16:16 + n]]
  return [q.turns[0] for q in load_prompt_set(name)[:n]]


def block_hits(target, drafter, prompts, answers) -> list[np.ndarray]:
  """Per row: [A, B-1] bool, block slot k of the anchor at each answer position a (but the last)
  hits the target's argmax for position a + k (misses past the row's end)."""
  from specjax.drafters.dflash import concat_taps
  from specjax.models.decoder import forward, logits_from_prenorm
  from specjax.models.kv_cache import KVCache
  from specjax.train.dflash import anchor_blocks
  cfg, params = target.cfg, target.params
  dp, dc = drafter.weights["dflash"], drafter.dc
  rows = [p + a for p, a in zip(prompts, answers)]
  width = max(len(r) for r in rows)
  toks = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    toks[i, :len(r)] = r
  lens = jnp.asarray([len(r) for r in rows], jnp.int32)
  logits, tapped, _ = forward(params, cfg, jnp.asarray(toks), KVCache.init(cfg, len(rows), width, dtype=jnp.float32),
                              n_new=lens, taps=dc.taps)
  argmax = np.asarray(jnp.argmax(logits, -1))                                       # [R, L] the target's next token
  taps = concat_taps(tapped["layers"])
  out = []
  for i, row in enumerate(rows):
    anchors = np.arange(len(prompts[i]), len(row) - 1)
    preds = []
    for c in range(0, len(anchors), 64):
      h = anchor_blocks(dp, params, cfg, dc, jnp.asarray(toks[i:i + 1]), taps[i:i + 1], jnp.asarray(anchors[None, c:c + 64]))
      preds.append(np.asarray(jnp.argmax(logits_from_prenorm(params, cfg, h[0, :, 1:]), -1)))   # [a, B-1]
    at = anchors[:, None] + np.arange(1, dc.block_size)[None, :]                   # predicted positions
    out.append((np.concatenate(preds) == argmax[i, np.minimum(at - 1, width - 1)]) & (at < len(row)))
  return out


def replay_rounds(hits: np.ndarray, n_answer: int, n_max: int) -> tuple[int, np.ndarray]:
  """(rounds, accepted by draft position) of greedy speculation over an answer of n_answer tokens
  whose first token came from the prefill; hits [n_answer - 1, B-1] from `block_hits`."""
  a, emitted, rounds, acc = 0, 1, 0, np.zeros(n_max, np.int64)
  while emitted < n_answer:
    n = int(np.cumprod(hits[a, :n_max]).sum())
    n = min(n, n_answer - emitted - 1)   # the answer ends (EOS or the budget) inside this round
    acc[:n] += 1
    a, emitted, rounds = a + n + 1, emitted + n + 1, rounds + 1
  return rounds, acc


def run_set(target, drafter, name: str, n: int, new: int, n_max: int, engine: bool) -> dict:
  from specjax.engine.decode import generate_plain
  from specjax.drafters.base import DraftParams
  from specjax.engine import speculative_generate
  from specjax.engine.sampling import SamplingParams
  t0 = time.perf_counter()
  tok = target.tokenizer
  prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in prompt_texts(name, n)]
  stop = tuple(tok.eos_ids)
  plain = generate_plain(target.params, target.cfg, prompts, max_new_tokens=new,
                         sampling=SamplingParams.make(len(prompts)), stop_ids=stop).tokens
  hits = block_hits(target, drafter, prompts, plain)
  allh = np.concatenate(hits)
  replay = [replay_rounds(h, len(a), n_max) for h, a in zip(hits, plain)]
  rounds = [r for r, _ in replay]
  res = {"prompts": len(prompts), "answer_tokens": sum(len(a) for a in plain), "anchors": len(allh),
         "teacher_forced_acc_by_slot": allh.mean(0).round(4).tolist(),
         "tau_uniform": round(float(1 + np.cumprod(allh[:, :n_max], 1).sum(1).mean()), 4),
         "tau_replayed": round((sum(len(a) for a in plain) - len(plain)) / sum(rounds), 4),
         "replayed_rounds": rounds,
         "replayed_acceptance_by_pos": (sum(a for _, a in replay) / sum(rounds)).round(4).tolist()}
  if engine:
    spec = speculative_generate(target.params, target.cfg, prompts, drafter, max_new_tokens=new,
                                sampling=SamplingParams.make(len(prompts)), draft_params=DraftParams(n_max=n_max),
                                stop_ids=stop)
    st = spec.stats
    res["engine"] = {"tau": round(st.emitted / max(st.rounds, 1), 4), "rounds": list(map(int, st.per_seq_rounds)),
                     "acceptance_by_pos": (np.asarray(st.accepted_by_pos) / np.maximum(np.asarray(st.drafted_by_pos), 1)
                                           ).round(4).tolist(),
                     "equal_to_plain": sum(a == b for a, b in zip(spec.tokens, plain))}
  res["seconds"] = round(time.perf_counter() - t0, 1)
  return res


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--head", default="assets/smollm2/dflash", help="folder holding dflash.safetensors")
  ap.add_argument("--n", type=int, default=8, help="prompts per set")
  ap.add_argument("--new", type=int, default=160, help="answer tokens at most")
  ap.add_argument("--n-max", type=int, default=15)
  ap.add_argument("--engine-sets", default="mt_bench,humaneval_heldout")
  ap.add_argument("--sets", default="humaneval_trained,gsm8k_trained,gsm8k_heldout,alpaca")
  ap.add_argument("--out", default="experiments/results/dflash_gap_cpu.json")
  args = ap.parse_args()
  from specjax.bench.env import device_info, git_revision
  from specjax.drafters.dflash import make_dflash_drafter
  from specjax.models.load import load_model
  target = load_model("smollm2-135m-instruct", dtype=jnp.float32, progress=False)
  drafter = make_dflash_drafter(target, args.head)
  out = {"head": args.head, "n": args.n, "max_new_tokens": args.new, "n_max": args.n_max, "dtype": "float32",
         "git_revision": git_revision(), "device": device_info(), "sets": {}}
  sets = [(s, True) for s in args.engine_sets.split(",") if s] + [(s, False) for s in args.sets.split(",") if s]
  for name, engine in sets:
    out["sets"][name] = run_set(target, drafter, name, args.n, args.new, args.n_max, engine)
    r = out["sets"][name]
    print(f"{name:18s} acc_01 {r['teacher_forced_acc_by_slot'][0]:.3f} tau_uniform {r['tau_uniform']:.3f} "
          f"tau_replayed {r['tau_replayed']:.3f}" + (f" engine tau {r['engine']['tau']:.3f}, rounds equal "
          f"{r['engine']['rounds'] == r['replayed_rounds']}" if engine else "") + f" ({r['seconds']} s)", flush=True)
    with open(args.out, "w") as f:
      f.write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
  main()
