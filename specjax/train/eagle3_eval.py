"""Acceptance and speed of a trained EAGLE-3 head: chains of several lengths and EAGLE-2 trees,
greedy and sampled, against plain decoding of the same batches in the same process (and, given
one, an MTP head's chain), measured by the bench harness (`specjax.train.head_eval`).

Per configuration: tau (tokens emitted per verification round, bonus included), acceptance by
draft position (chains) or by depth (trees), tau by category, tokens/s and the speedup over plain
decoding, and (greedy) the share of outputs equal to plain decoding's. Each chain length has its
own drafter, so its verification is n_max + 1 tokens wide (`verify_width`).
"""

from __future__ import annotations


def evaluate_eagle3(target, head, *, prompt_set: str = "mt_bench", n_questions: int = 16, n_max=(1, 2, 3, 4, 5),
                    tree: dict | None = None, temperatures=(0.0, 0.7), max_new_tokens: int = 128,
                    batch_size: int = 8, mtp_head=None, mtp_n_max: int = 3, seed: int = 0,
                    progress: bool = True, on_result=None) -> dict:
  """`head`: a head file (or folder). `tree`: {"depth", "top_k", "budget"} of the tree drafter (None:
  no tree runs). `on_result(res)` is called with the result so far after every configuration (e.g.
  to keep a partial JSON)."""
  from specjax.bench.env import device_info, git_revision
  from specjax.bench.prompts import load_prompt_set
  from specjax.train.head_eval import evaluate_rows, head_method

  questions = load_prompt_set(prompt_set)[:n_questions]
  labels = {}                      # method label -> (kind, its fields in the result, verify width)
  methods = []
  for nm in n_max:
    methods.append(head_method(target, f"chain{nm}", "eagle3", head, nm))
    labels[f"chain{nm}"] = ("chain", {"n_max": nm}, nm + 1)
  if tree:
    methods.append(head_method(target, "tree", "eagle3_tree", head, tree["depth"],
                               {"depth": tree["depth"], "top_k": tree["top_k"], "n_nodes": tree["budget"]}))
    labels["tree"] = ("tree", dict(tree), tree["budget"] + 1)
  if mtp_head:
    methods.append(head_method(target, "mtp", "mtp", mtp_head, mtp_n_max))
    labels["mtp"] = ("mtp", {"n_max": mtp_n_max}, mtp_n_max + 1)
  results, plain_rows = [], []

  def report():
    return {"prompt_set": prompt_set, "questions": [q.question_id for q in questions],
            "categories": [q.category for q in questions], "max_new_tokens": max_new_tokens,
            "batch_size": batch_size, "temperatures": list(temperatures), "plain": plain_rows, "results": results,
            "head": str(head), "mtp_head": str(mtp_head) if mtp_head else None, "git_revision": git_revision(),
            "device": device_info()}

  def add(rows):
    row = rows[-1]
    if row["method"] == "plain":
      plain_rows.append({k: row[k] for k in ("temperature", "tokens", "seconds", "tokens_per_s")})
      return
    kind, fields, width = labels[row["method"]]
    results.append({"kind": kind, "temperature": row["temperature"], **fields,
                    **{k: row.get(k) for k in ("tau", "rounds", "tokens", "acceptance_by_pos", "drafted_by_pos")},
                    "verify_width": width,
                    **{k: row.get(k) for k in ("tokens_per_s", "speedup", "equal_to_plain", "tau_by_category")}})
    if on_result is not None:
      on_result(report())

  evaluate_rows(target, questions, methods, temperatures=temperatures, max_new_tokens=max_new_tokens,
                batch_size=batch_size, seed=seed, on_row=add, progress=progress, tag="eval eagle3")
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
