"""Is a DFlash drafter's gap between training scores and engine acceptance a matter of prompts or of
inference? For the first turns of an evaluation prompt set this scores the drafter the way training
does (tau_est and top-1 accuracy per block slot at uniformly drawn anchors of the target's own
greedy answers: `specjax.train.dflash_run.score_blocks`) and runs the engine's greedy `dflash` on the
same prompts (tau, acceptance by position). The answers are only scored, never trained on.

  python experiments/dflash_scores_vs_engine.py --head assets/smollm2/dflash/dflash.safetensors \
      --prompt-set mt_bench --n 16 --out experiments/results/dflash_scores_vs_engine_gpu4_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--head", required=True)
  ap.add_argument("--target", default="smollm2-135m-instruct")
  ap.add_argument("--prompt-set", action="append", default=None)
  ap.add_argument("--n", type=int, default=16, help="first turns of each prompt set")
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--batch-size", type=int, default=16)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--anchors", type=int, default=32, help="anchors per row for the training-style scores")
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)

  from specjax.bench.env import device_info, git_revision
  from specjax.engine.decode import generate_plain
  from specjax.drafters.base import DraftParams
  from specjax.drafters.dflash import load_dflash
  from specjax.drafters.registry import make_speculator
  from specjax.engine import speculative_generate
  from specjax.engine.generation import PROMPT_BUCKET, round_up
  from specjax.models.load import load_model
  from specjax.engine.sampling import SamplingParams
  from specjax.train.dflash import LossConfig, make_loss_fn
  from specjax.train.dflash_run import score_blocks
  from specjax.train.dflash_eval import first_turns

  target = load_model(a.target, dtype=jnp.dtype(a.dtype))
  params, cfg = target.params, target.cfg
  dparams, dc, _ = load_dflash(a.head, cfg, dtype=jnp.float32)
  n_max = dc.block_size - 1
  drafter = make_speculator("dflash", target, head=a.head, draft_params=DraftParams(n_max=n_max))
  loss_fn = make_loss_fn(cfg, dc, LossConfig(anchors_per_row=a.anchors, batch_size=a.batch_size), jnp.dtype(a.dtype))
  stop = tuple(target.tokenizer.eos_ids)
  results = []
  for ps in a.prompt_set or ["mt_bench"]:
    _, prompts = first_turns(target, ps, a.n)
    cap = round_up(round_up(max(len(p) for p in prompts), PROMPT_BUCKET) + a.max_new_tokens + n_max + 2, 64)
    greedy = lambda n: SamplingParams.make(n, temperature=0.0, seed=list(range(n)))
    t0 = time.perf_counter()
    answers, rounds, emitted, drafted, accepted = [], 0, 0, 0, 0
    for i in range(0, len(prompts), a.batch_size):
      chunk = prompts[i:i + a.batch_size]
      answers += generate_plain(params, cfg, chunk, max_new_tokens=a.max_new_tokens, sampling=greedy(len(chunk)),
                                stop_ids=stop, capacity=cap).tokens
      r = speculative_generate(params, cfg, chunk, drafter, max_new_tokens=a.max_new_tokens,
                               sampling=greedy(len(chunk)), draft_params=DraftParams(n_max=n_max),
                               stop_ids=stop, capacity=cap)
      rounds += r.stats.rounds
      emitted += r.stats.emitted
      drafted = drafted + np.asarray(r.stats.drafted_by_pos[:n_max])
      accepted = accepted + np.asarray(r.stats.accepted_by_pos[:n_max])
    # the target's greedy answers as training-style rows: prompt + answer, right-padded
    seqs = [list(p) + list(t) for p, t in zip(prompts, answers)]
    width = max(len(s) for s in seqs)
    rows = {"tokens": np.zeros((len(seqs), width), np.int32), "lens": np.array([len(s) for s in seqs], np.int32),
            "prompt_lens": np.array([len(p) for p in prompts], np.int32)}
    for j, s in enumerate(seqs):
      rows["tokens"][j, :len(s)] = s

    class Rows:   # the ShardDataset interface score_blocks reads
      def __len__(self):
        return len(seqs)

      def rows(self, idx, with_taps=False):
        return {k: v[idx] for k, v in rows.items()}

    scores = score_blocks(loss_fn, dparams, params, Rows(), np.arange(len(seqs)), a.batch_size)
    engine = {"tau": emitted / max(rounds, 1), "rounds": int(rounds),
              "acceptance_by_pos": (accepted / np.maximum(drafted, 1)).round(4).tolist()}
    res = {"prompt_set": ps, "n": len(prompts), "answer_tokens": int(sum(len(t) for t in answers)),
           "training_style": scores, "engine": engine, "seconds": round(time.perf_counter() - t0, 1)}
    print(f"[{ps}] tau_est {scores['tau_est']} acc {[scores[f'acc_{k:02d}'] for k in (1, 2, 3, 4)]} | "
          f"engine tau {engine['tau']:.3f} acc {engine['acceptance_by_pos'][:4]}", flush=True)
    results.append(res)
  out = {"head": a.head, "target": a.target, "dtype": a.dtype, "max_new_tokens": a.max_new_tokens,
         "results": results, "git_revision": git_revision(), "device": device_info()}
  if a.out:
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
  return out


if __name__ == "__main__":
  main()
