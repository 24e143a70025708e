"""Acceptance and speed of a trained EAGLE-3 head: chains of several lengths and EAGLE-2 trees,
greedy and sampled, against plain decoding of the same batches in the same process (and, given
one, an MTP head's chain).

Per configuration: tau (tokens emitted per verification round, bonus included), acceptance by
draft position (chains) or by depth (trees), tokens/s and the speedup over plain decoding, and
(greedy) the share of outputs equal to plain decoding's. Every run is preceded by an untimed run
of the same batch (compilation, warm caches). Chains of every n_max share one drafter of the
longest length (n_max is a run-time parameter), so they compile once; their verification is
max(n_max) + 1 tokens wide whatever n_max is, which `verify_width` records.
"""

from __future__ import annotations

import time

import numpy as np


def _questions(prompt_set: str, n_questions: int):
  from specjax.bench.prompts import load_prompt_set
  return load_prompt_set(prompt_set)[:n_questions]


def evaluate_eagle3(target, head, *, prompt_set: str = "mt_bench", n_questions: int = 16, n_max=(1, 2, 3, 4, 5),
                    tree: dict | None = None, temperatures=(0.0, 0.7), max_new_tokens: int = 128,
                    batch_size: int = 8, mtp_head=None, mtp_n_max: int = 3, seed: int = 0,
                    progress: bool = True, on_result=None) -> dict:
  """`tree`: {"depth", "top_k", "budget"} of the tree drafter (None: no tree runs). `on_result(res)`
  is called with the result so far after every configuration (e.g. to keep a partial JSON)."""
  from specjax.bench.env import device_info, git_revision
  from specjax.engine.decode import generate_plain
  from specjax.drafters.base import DraftParams
  from specjax.drafters.eagle3 import make_eagle3_drafter
  from specjax.engine import speculative_generate
  from specjax.engine.generation import PROMPT_BUCKET, round_up
  from specjax.engine.sampling import SamplingParams

  questions = _questions(prompt_set, n_questions)
  tok = target.tokenizer
  prompts = [tok.encode_chat([{"role": "user", "content": q.turns[0]}]) for q in questions]
  stop = tuple(tok.eos_ids)
  batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
  widest = max(max(n_max), (tree or {}).get("budget", 0), mtp_n_max if mtp_head else 0)
  cap = round_up(round_up(max(len(p) for p in prompts), PROMPT_BUCKET) + max_new_tokens + widest + 2, 64)
  params, cfg = target.params, target.cfg

  def sampling(n, temp):
    return SamplingParams.make(n, temperature=temp, seed=[seed + i for i in range(n)])

  def timed(fn):
    """Run every batch untimed, then timed; -> (outputs, seconds, stats list)."""
    toks, secs, stats = [], 0.0, []
    for chunk in batches:
      fn(chunk)
      t0 = time.perf_counter()
      r = fn(chunk)
      secs += time.perf_counter() - t0
      toks += r.tokens
      stats.append(getattr(r, "stats", None))
    return toks, secs, stats

  def summarize(kind, label, toks, secs, stats, plain, width):
    rounds = sum(s.rounds for s in stats)
    emitted = sum(s.emitted for s in stats)
    drafted = np.sum([s.drafted_by_pos for s in stats], axis=0)
    accepted = np.sum([s.accepted_by_pos for s in stats], axis=0)
    n_tok = sum(len(t) for t in toks)
    row = {"kind": kind, **label, "tau": emitted / max(rounds, 1), "rounds": rounds, "tokens": n_tok,
           "acceptance_by_pos": (accepted / np.maximum(drafted, 1)).round(4).tolist(),
           "drafted_by_pos": drafted.tolist(), "verify_width": width,
           "tokens_per_s": n_tok / secs, "speedup": (n_tok / secs) / plain["tokens_per_s"],
           "equal_to_plain": sum(a == b for a, b in zip(toks, plain["outputs"])) / len(toks)}
    if progress:
      print(f"[eval eagle3] T={label['temperature']} {kind} {label}: tau {row['tau']:.3f}, acceptance "
            f"{row['acceptance_by_pos'][:8]}, {row['tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x plain), "
            f"equal {row['equal_to_plain']:.2f}", flush=True)
    return row

  chain = make_eagle3_drafter(target, head, DraftParams(n_max=max(n_max)))
  tree_d = None
  if tree:
    tree_d = make_eagle3_drafter(target, head, DraftParams(n_max=tree["budget"]), tree=True,
                                 depth=tree["depth"], top_k=tree["top_k"])
  mtp = None
  if mtp_head:
    from specjax.drafters.mtp import make_mtp_drafter
    mtp = make_mtp_drafter(target, mtp_head, DraftParams(n_max=mtp_n_max))
  results, plain_rows = [], []

  def report():
    return {"prompt_set": prompt_set, "questions": [q.question_id for q in questions],
            "categories": [q.category for q in questions], "max_new_tokens": max_new_tokens,
            "batch_size": batch_size, "temperatures": list(temperatures), "plain": plain_rows, "results": results,
            "head": str(head), "mtp_head": str(mtp_head) if mtp_head else None, "git_revision": git_revision(),
            "device": device_info()}

  def add(row):
    results.append(row)
    if on_result is not None:
      on_result(report())

  for temp in temperatures:
    toks, secs, _ = timed(lambda c: generate_plain(params, cfg, c, max_new_tokens=max_new_tokens,
                                                    sampling=sampling(len(c), temp), stop_ids=stop, capacity=cap))
    plain = {"temperature": temp, "tokens": sum(len(t) for t in toks), "seconds": secs,
             "tokens_per_s": sum(len(t) for t in toks) / secs, "outputs": toks}
    plain_rows.append({k: v for k, v in plain.items() if k != "outputs"})
    if progress:
      print(f"[eval eagle3] T={temp} plain: {plain['tokens_per_s']:.1f} tok/s", flush=True)

    def spec(drafter, dp):
      return timed(lambda c: speculative_generate(params, cfg, c, drafter, max_new_tokens=max_new_tokens,
                                                  sampling=sampling(len(c), temp), draft_params=dp, stop_ids=stop,
                                                  capacity=cap))

    for nm in n_max:
      out = spec(chain, DraftParams(n_max=nm))
      add(summarize("chain", {"temperature": temp, "n_max": nm}, *out, plain, max(n_max) + 1))
    if tree_d is not None:
      out = spec(tree_d, DraftParams(n_max=tree["budget"]))
      add(summarize("tree", {"temperature": temp, **tree}, *out, plain, tree["budget"] + 1))
    if mtp is not None:
      out = spec(mtp, DraftParams(n_max=mtp_n_max))
      add(summarize("mtp", {"temperature": temp, "n_max": mtp_n_max}, *out, plain, mtp_n_max + 1))
  return report()


def plot_eval(res: dict, out_png) -> None:
  """Three panels: tau by chain length (tree and MTP as markers), acceptance by position / depth,
  tokens/s against plain decoding; one color per temperature."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
  colors = dict(zip(res["temperatures"], ("tab:blue", "tab:orange", "tab:green", "tab:red")))
  for temp in res["temperatures"]:
    c = colors[temp]
    rows = [r for r in res["results"] if r["temperature"] == temp]
    chain = [r for r in rows if r["kind"] == "chain"]
    axes[0].plot([r["n_max"] for r in chain], [r["tau"] for r in chain], "o-", color=c, label=f"chain T={temp}")
    for r in rows:
      if r["kind"] == "tree":
        axes[0].axhline(r["tau"], color=c, ls="--", label=f"tree T={temp} (d{r['depth']} k{r['top_k']} "
                                                          f"{r['budget']} nodes)")
        axes[1].plot(range(1, len(r["acceptance_by_pos"]) + 1), r["acceptance_by_pos"], "s--", color=c,
                     label=f"tree by depth T={temp}")
      if r["kind"] == "mtp":
        axes[0].plot([r["n_max"]], [r["tau"]], "x", ms=10, color=c, label=f"MTP n_max={r['n_max']} T={temp}")
    if chain:
      longest = max(chain, key=lambda r: r["n_max"])
      axes[1].plot(range(1, longest["n_max"] + 1), longest["acceptance_by_pos"][:longest["n_max"]], "o-", color=c,
                   label=f"chain n_max={longest['n_max']} T={temp}")
  axes[0].set(xlabel="chain n_max", ylabel="tau (tokens / round)", title="tau")
  axes[1].set(xlabel="draft position / tree depth", ylabel="P(accepted | reached)", title="acceptance", ylim=(0, 1))
  labels, speeds = [], []
  for r in res["results"]:
    labels.append(f"{r['kind']}{r.get('n_max', '')} T{r['temperature']}")
    speeds.append(r["speedup"])
  axes[2].barh(range(len(speeds)), speeds, color=[colors[r["temperature"]] for r in res["results"]])
  axes[2].set_yticks(range(len(speeds)), labels, fontsize=7)
  axes[2].axvline(1.0, color="k", lw=1)
  axes[2].set(xlabel="speedup over plain decoding (tokens/s)", title=res["device"].get("device_kind", ""))
  for ax in axes[:2]:
    ax.legend(fontsize=7)
  fig.suptitle(f"EAGLE-3 head on {res['prompt_set']} ({len(res['questions'])} questions, {res['max_new_tokens']} "
               f"new tokens, batch {res['batch_size']}), rev {res['git_revision'][:10]}")
  fig.tight_layout()
  fig.savefig(out_png, dpi=110)
  plt.close(fig)
