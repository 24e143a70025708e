"""llama.cpp beside specjax on one GPU: the same GGUF file, the same prompts, batch 1, greedy
(issue 25, goal 5). `experiments/gpu/llamacpp.sh` builds llama.cpp and calls `run`; this file
runs both sides and merges them into one JSON.

    python experiments/llamacpp_side_by_side.py prompts --out .gpucarry/llamacpp/prompts.jsonl
    python experiments/llamacpp_side_by_side.py run --bin BUILD/bin --src LLAMA_SRC --gguf MODEL.gguf \\
        --prompts .gpucarry/llamacpp/prompts.jsonl --state DIR --out OUT_DIR [--deadline-s 500]
    python experiments/llamacpp_side_by_side.py parse {bench,spec,completion} SAVED_OUTPUT
    python experiments/llamacpp_side_by_side.py selftest [--write DIR]

What runs (batch 1, greedy, 256 new tokens; llama.cpp with all layers on the GPU, flash attention on
except where llama-bench also measures it off):
- llama.cpp: `llama-bench -p 0 -n 256 -fa 0,1 -o json` (plain decoding, no prompt); per prompt
  `llama-completion` (plain decoding) and `llama-speculative-simple` with n-gram speculation
  (`--spec-type ngram-simple`) at llama.cpp's defaults (n 12, m 48), at n 3 / m 16 and at n 3 / m 8
  (= specjax's tuned drafts, which are cut at 8), and once with n 1024 / m 1: a draft needs more
  than 1026 tokens of history, so it never drafts here -- plain decoding in the speculative loop,
  timed by that loop's own timer (the denominator of llama.cpp's speedups).
- specjax (`specjax bench` on a config written here, same GGUF path, same prompts): plain decoding,
  tuned ngram_simple (size_n 3, size_m 16, n_max 8, n_min 1: configs/bench_engine_regression_*,
  experiments/results/tune_smollm2_device_h100/best.yaml) and ngram_simple with llama.cpp's n, m
  (n_max = m, n_min 0) for like-for-like rows.
With --draft-gguf (Qwen2.5-Coder 0.5B drafting for 1.5B, both Q4_K_M GGUFs): plain decoding, n-gram
speculation at n 3 / m 16, and draft-model speculation (`--spec-type draft-simple -md DRAFT`) at
llama.cpp's defaults (n_max 3, p_min 0) and at n_max 16 / p_min 0.75; specjax runs its `draft`
speculator with the same n_max / p_min on the same two files (dequantized to --dtype).

Resumable: every finished llama.cpp run and specjax row is kept under --state; a second call
continues where the first stopped (`specjax bench --resume`), and the merged JSON is rewritten
after every step with `complete` false until everything ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = "smollm2-135m-instruct"
PROMPT_BUCKET = 64            # specjax pads prompts to multiples of this; each new width compiles anew
RESULT = "llamacpp_side_by_side.json"
SPECJAX_NAME = "llamacpp_side_by_side_specjax"

# --- what runs -------------------------------------------------------------------------------------

COMMON = ["-ngl", "99", "-fa", "on", "-c", "2048", "--temp", "0", "--seed", "0"]   # + -n MAX_NEW
LLAMA_METHODS: dict[str, dict] = {
    "plain_completion": {"binary": "llama-completion", "args": ["-no-cnv", "--no-display-prompt"],
                         "what": "llama-completion, no speculation"},
    "plain_spec_loop": {"binary": "llama-speculative-simple",
                        "args": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1024",
                                 "--spec-ngram-simple-size-m", "1"],
                        "what": "llama-speculative-simple that never drafts (n 1024 needs > 1026 tokens of history): "
                                "plain decoding in the speculative loop, same timer as the n-gram rows"},
    "ngram_simple_n3_m8": {"binary": "llama-speculative-simple",
                           "args": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                    "--spec-ngram-simple-size-m", "8"],
                           "what": "n-gram speculation as specjax's tuned ngram_simple drafts (n 3, up to 8 tokens)"},
    "ngram_simple_n3_m16": {"binary": "llama-speculative-simple",
                            "args": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                     "--spec-ngram-simple-size-m", "16"],
                            "what": "n-gram speculation, n 3, m 16"},
    "ngram_simple_n12_m48": {"binary": "llama-speculative-simple",
                             "args": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "12",
                                      "--spec-ngram-simple-size-m", "48"],
                             "what": "n-gram speculation at llama.cpp's defaults (n 12, m 48)"},
}
LLAMA_PLAIN = "plain_spec_loop"          # llama.cpp speedups are per prompt against this row
SPEC_VERBOSITY = ["-lv", "4"]            # the per-speculator statistics line is printed at level 4 (trace)

SPECJAX_METHODS = [
    {"name": "ngram_simple_tuned", "speculator": "ngram_simple", "options": {"size_n": 3, "size_m": 16},
     "draft_params": {"n_max": 8, "n_min": 1}},
    {"name": "ngram_simple_n3_m16", "speculator": "ngram_simple", "options": {"size_n": 3, "size_m": 16},
     "draft_params": {"n_max": 16, "n_min": 0}},
    {"name": "ngram_simple_n12_m48", "speculator": "ngram_simple", "options": {"size_n": 12, "size_m": 48},
     "draft_params": {"n_max": 48, "n_min": 0}},
]
PAIRS = [  # (specjax method, llama.cpp method): the same drafts on both sides
    ("plain", "plain_spec_loop"),
    ("ngram_simple_tuned", "ngram_simple_n3_m8"),
    ("ngram_simple_n3_m16", "ngram_simple_n3_m16"),
    ("ngram_simple_n12_m48", "ngram_simple_n12_m48"),
]

# With --draft-gguf (Qwen2.5-Coder 0.5B drafting for 1.5B): plain decoding, one n-gram setting and
# draft-model speculation at llama.cpp's defaults (n_max 3, n_min 0, p_min 0) and at a longer draft
# cut by the draft's confidence (n_max 16, p_min 0.75), the same on both sides.
def _draft_args(n_max: int, p_min: float) -> list[str]:
  return ["--spec-type", "draft-simple", "-md", "{draft}", "-ngld", "99", "--spec-draft-n-max", str(n_max),
          "--spec-draft-n-min", "0", "--spec-draft-p-min", str(p_min)]


PAIR_LLAMA_METHODS: dict[str, dict] = {
    **{k: LLAMA_METHODS[k] for k in ("plain_completion", "plain_spec_loop", "ngram_simple_n3_m16")},
    "draft_n3": {"binary": "llama-speculative-simple", "args": _draft_args(3, 0.0),
                 "what": "draft-model speculation at llama.cpp's defaults (n_max 3, n_min 0, p_min 0)"},
    "draft_n16_p075": {"binary": "llama-speculative-simple", "args": _draft_args(16, 0.75),
                       "what": "draft-model speculation, up to 16 tokens, stopped when the draft's top "
                               "probability is below 0.75"},
}
PAIR_SPECJAX_METHODS = [
    SPECJAX_METHODS[1],
    {"name": "draft_n3", "speculator": "draft", "draft_model": "{draft}", "draft_params": {"n_max": 3, "n_min": 0}},
    {"name": "draft_n16_p075", "speculator": "draft", "draft_model": "{draft}",
     "draft_params": {"n_max": 16, "n_min": 0, "p_min": 0.75}},
]
PAIR_PAIRS = [("plain", "plain_spec_loop"), ("ngram_simple_n3_m16", "ngram_simple_n3_m16"),
              ("draft_n3", "draft_n3"), ("draft_n16_p075", "draft_n16_p075")]


def suite(args) -> tuple[dict, list, list]:
  """(llama.cpp methods, specjax methods, pairs) this run compares, the draft GGUF's path filled in."""
  if not getattr(args, "draft_gguf", None):
    return LLAMA_METHODS, SPECJAX_METHODS, PAIRS
  draft = str(Path(args.draft_gguf).resolve())
  fill = lambda x: [draft if a == "{draft}" else a for a in x]
  llama = {k: {**m, "args": fill(m["args"])} for k, m in PAIR_LLAMA_METHODS.items()}
  specjax = [{**m, "draft_model": draft} if m.get("draft_model") else m for m in PAIR_SPECJAX_METHODS]
  return llama, specjax, PAIR_PAIRS


NOTES = [
    "Both sides read the same GGUF file (path and sha256 under model) and the same prompts: each MT-bench "
    "first turn rendered with the GGUF's chat template by specjax; llama.cpp gets that text with -p and "
    "tokenizes it with special tokens parsed (prompts[].llama_cpp_tokenization_equal: specjax's tokenizer "
    "gives the same tokens that way; llama_cpp_runs[].prompt_tokens_match: llama.cpp counted as many).",
    "Timers: llama-speculative-simple's 'decoded N tokens in T s' covers the decode loop after the prompt "
    "(N counts every sampled token); llama-completion's decode rate is eval runs / (total - prompt eval) "
    "from its perf print (eval-only rate beside it); llama-bench tg256 times 256 single-token decodes "
    "with no prompt and no sampling; specjax's seconds are the wall time of one generate call "
    "(prefill + decode, compilation excluded by an untimed warm-up per prompt width).",
    "Speedups are the mean over prompts of (method tok/s / plain tok/s on that prompt), each side against "
    "its own plain row in the same loop: specjax's plain decoding, llama.cpp's plain_spec_loop.",
    "tau = tokens emitted per target forward (llama.cpp: n_predict / draft calls, one call per loop "
    "iteration); acceptance = accepted / drafted tokens.",
    "Prompts: the first question of each MT-bench category whose first turn fits one 64-token prompt "
    "bucket (so specjax compiles 2 prompt widths per method, not 3-4); extraction has none, so its "
    "first question (131) is taken.",
]


# --- prompts ---------------------------------------------------------------------------------------


def load_tokenizer(gguf: str | None):
  from specjax.io.tokenizer import Tokenizer
  if gguf is None:
    from specjax.io.fetch import model_path
    gguf = str(model_path(MODEL))
  return Tokenizer.from_gguf(gguf)


def render(tok, turn: str) -> tuple[str, list[int], bool]:
  """(the chat text llama.cpp gets, specjax's prompt tokens, whether llama.cpp's way of tokenizing
  that text -- special tokens parsed, the file's BOS rule -- gives the same tokens)."""
  msgs = [{"role": "user", "content": turn}]
  ids = tok.encode_chat(msgs)
  text = tok.apply_chat_template(msgs)
  return text, ids, tok.encode(text, parse_special=True) == ids


def pick_questions(questions, tok, bucket: int = PROMPT_BUCKET) -> list:
  """Per category (in file order) the first question whose first turn fits `bucket` tokens, else the
  category's first question."""
  by_cat: dict[str, list] = {}
  for q in questions:
    by_cat.setdefault(q.category, []).append(q)
  out = []
  for qs in by_cat.values():
    fits = [q for q in qs if len(render(tok, q.turns[0])[1]) <= bucket]
    out.append(fits[0] if fits else qs[0])
  return out


def cmd_prompts(args) -> int:
  from specjax.bench.prompts import load_prompt_set
  tok = load_tokenizer(args.gguf)
  questions = load_prompt_set(args.source)
  chosen = [q for q in questions if q.question_id in args.ids.split(",")] if args.ids else pick_questions(questions, tok)
  Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    for q in chosen:
      f.write(json.dumps({"question_id": q.question_id, "category": q.category, "turns": [q.turns[0]]}) + "\n")
  for q in chosen:
    print(q.question_id, q.category, len(render(tok, q.turns[0])[1]), "tokens")
  print(f"wrote {len(chosen)} prompts to {args.out}", file=sys.stderr)
  return 0


# --- parsing llama.cpp's output --------------------------------------------------------------------

_NUM = r"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|-?nan|-?inf)"


def _num(s: str) -> float | None:
  try:
    x = float(s)
  except (TypeError, ValueError):
    return None
  return None if math.isnan(x) else x


def _search(pattern: str, text: str, cast=float):
  m = re.search(pattern, text)
  if m is None:
    return None
  vals = [(_num(g) if cast is float else int(g)) for g in m.groups()]
  return vals[0] if len(vals) == 1 else vals


BENCH_KEEP = ("build_commit", "build_number", "gpu_info", "backends", "model_filename", "model_type", "model_size",
              "model_n_params", "n_gpu_layers", "flash_attn", "n_batch", "n_ubatch", "type_k", "type_v",
              "n_prompt", "n_gen", "n_depth", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "samples_ts")


def parse_llama_bench(text: str) -> list[dict]:
  """The tests of `llama-bench -o json` (stdout: one JSON array), the fields that matter here."""
  text = text.strip()
  try:
    rows = json.loads(text)
  except ValueError:
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
      raise ValueError("no JSON array in llama-bench output") from None
    rows = json.loads(text[start: end + 1])
  return [{k: r.get(k) for k in BENCH_KEEP if k in r} for r in rows]


def parse_perf(text: str) -> dict:
  """common_perf_print / llama_perf_context_print: times in ms."""
  out = {
      "sampling_ms": _search(r"sampling time =\s*" + _NUM + r" ms", text),
      "load_ms": _search(r"load time =\s*" + _NUM + r" ms", text),
      "prompt_eval": _search(r"prompt eval time =\s*" + _NUM + r" ms /\s*(\d+) tokens", text),
      "eval": _search(r"(?<!prompt )\beval time =\s*" + _NUM + r" ms /\s*(\d+) runs", text),
      "total": _search(r"total time =\s*" + _NUM + r" ms /\s*(\d+) tokens", text),
      "graphs_reused": _search(r"graphs reused =\s*(\d+)", text, int),
  }
  perf = {"sampling_ms": out["sampling_ms"], "load_ms": out["load_ms"], "graphs_reused": out["graphs_reused"]}
  for key in ("prompt_eval", "eval", "total"):
    v = out[key]
    perf[f"{key}_ms"], perf[f"{key}_n"] = (v[0], int(v[1])) if v else (None, None)
  return perf


def parse_completion(text: str) -> dict:
  """llama-completion: decode rate from its perf print (eval runs over the time after the prompt)."""
  p = parse_perf(text)
  r = {"perf": p, "eval_runs": p["eval_n"], "prompt_tokens": p["prompt_eval_n"],
       "end_of_text": "[end of text]" in text}
  if p["eval_ms"] and p["eval_n"]:
    r["eval_only_tokens_per_s"] = p["eval_n"] / (p["eval_ms"] / 1e3)
  if p["total_ms"] is not None and p["prompt_eval_ms"] is not None and p["eval_n"]:
    decode_ms = p["total_ms"] - p["prompt_eval_ms"]
    r["decode_seconds"] = decode_ms / 1e3
    r["new_tokens"] = p["eval_n"]
    r["tokens_per_s"] = p["eval_n"] / (decode_ms / 1e3) if decode_ms > 0 else None
  return r


_STATS = (r"statistics\s+(\S+):\s*#calls\(b,g,a\) =\s*(\d+)\s+(\d+)\s+(\d+), #gen drafts =\s*(\d+), "
          r"#acc drafts =\s*(\d+), #gen tokens =\s*(\d+), #acc tokens =\s*(\d+)")


def parse_speculative_simple(text: str) -> dict:
  """llama-speculative-simple's summary: decode rate, drafted / accepted tokens, per-speculator
  statistics (with -lv 4), perf print."""
  enc = _search(r"encoded\s+(\d+) tokens in\s*" + _NUM + r" seconds", text)
  dec = _search(r"decoded\s+(\d+) tokens in\s*" + _NUM + r" seconds, speed:\s*" + _NUM + r" t/s", text)
  r: dict = {
      "prompt_tokens": int(enc[0]) if enc else None,
      "encode_seconds": enc[1] if enc else None,
      "new_tokens": int(dec[0]) if dec else None,
      "decode_seconds": dec[1] if dec else None,
      "tokens_per_s": dec[2] if dec else None,
      "n_predict": _search(r"n_predict\s*=\s*(\d+)", text, int),
      "n_drafted": _search(r"n_drafted\s*=\s*(\d+)", text, int),
      "n_accept": _search(r"n_accept\s*=\s*(\d+)", text, int),
      "accept_pct": _search(r"accept\s*=\s*" + _NUM + r"%", text),
      "perf": parse_perf(text),
  }
  if r["tokens_per_s"] is None and r["new_tokens"] and r["decode_seconds"]:
    r["tokens_per_s"] = r["new_tokens"] / r["decode_seconds"]
  m = re.search(_STATS, text)
  if m:
    g = m.groups()
    r["stats"] = {"type": g[0], "calls_begin": int(g[1]), "calls_draft": int(g[2]), "calls_accept": int(g[3]),
                  "gen_drafts": int(g[4]), "acc_drafts": int(g[5]), "gen_tokens": int(g[6]), "acc_tokens": int(g[7])}
    mean = re.search(r"#mean acc len =\s*" + _NUM, text)
    r["stats"]["mean_acc_len"] = _num(mean.group(1)) if mean else None
    if r["stats"]["calls_draft"] and r["n_predict"]:
      r["tau"] = r["n_predict"] / r["stats"]["calls_draft"]
  if r["n_drafted"]:
    r["acceptance_rate"] = r["n_accept"] / r["n_drafted"]
  return r


PARSERS = {"bench": parse_llama_bench, "spec": parse_speculative_simple, "completion": parse_completion}


def cmd_parse(args) -> int:
  print(json.dumps(PARSERS[args.kind](Path(args.file).read_text(errors="replace")), indent=1))
  return 0


# --- self-test of the parsers on outputs written with llama.cpp's own format strings -------------

_PERF_FMT = [  # common/sampling.cpp common_perf_print, in order
    "%s:    sampling time = %10.2f ms", "%s:    samplers time = %10.2f ms / %5d tokens", "%s:        load time = %10.2f ms",
    "%s: prompt eval time = %10.2f ms / %5d tokens (%8.2f ms per token, %8.2f tokens per second)",
    "%s:        eval time = %10.2f ms / %5d runs   (%8.2f ms per token, %8.2f tokens per second)",
    "%s:       total time = %10.2f ms / %5d tokens",
    "%s: unaccounted time = %10.2f ms / %5.1f %%      (total - sampling - prompt eval - eval) / (total)",
    "%s:    graphs reused = %10d"]


def _sample_perf(p_ms, p_n, e_ms, e_n, total_ms) -> list[str]:
  f = "common_perf_print"
  return [_PERF_FMT[0] % (f, 9.5), _PERF_FMT[1] % (f, 4.25, e_n + 1), _PERF_FMT[2] % (f, 812.4),
          _PERF_FMT[3] % (f, p_ms, p_n, p_ms / p_n, 1e3 * p_n / p_ms),
          _PERF_FMT[4] % (f, e_ms, e_n, e_ms / e_n, 1e3 * e_n / e_ms), _PERF_FMT[5] % (f, total_ms, p_n + e_n),
          _PERF_FMT[6] % (f, 3.0, 1.0), _PERF_FMT[7] % (f, e_n - 1)]


def sample_speculative_simple(n_drafted=312, n_accept=201, calls=120) -> str:
  """examples/speculative-simple/speculative-simple.cpp's summary (+ the -lv 4 statistics line)."""
  acc = 100.0 * n_accept / n_drafted if n_drafted else float("nan")
  stats = ("spec %12.12s: " % "common_speculative_print_stats"
           + "statistics %16s: #calls(b,g,a) = %4d %6d %6d, #gen drafts = %6d, #acc drafts = %5d, #gen tokens = %6d, "
             "#acc tokens = %5d%s%s" % ("ngram-simple", 1, calls, calls, 80, 70, n_drafted, n_accept,
                                       ", dur(b,g,a) = 0.001, 0.512, 0.020 ms",
                                       ", #mean acc len = 3.51, #acc rate/pos = (0.875, 0.750)" if n_drafted else ""))
  return "\n".join([
      "<|im_start|>system ... the prompt and the answer, echoed", "",
      "encoded %4d tokens in %8.3f seconds, speed: %8.3f t/s" % (53, 0.012, 53 / 0.012),
      "decoded %4d tokens in %8.3f seconds, speed: %8.3f t/s" % (257, 0.187, 257 / 0.187), "",
      "n_draft   = %d" % 3, "n_predict = %d" % 257, "n_drafted = %d" % n_drafted, "n_accept  = %d" % n_accept,
      ("accept    = %.3f%%" % acc) if n_drafted else "accept    = -nan%", "", "draft:", "", stats, "", "target:", "",
      *_sample_perf(41.0, 52 + n_drafted, 150.0, 40, 420.0), ""])


def sample_completion() -> str:
  """tools/completion: the answer, ' [end of text]', common_perf_print."""
  return "\n".join(["The answer ... [end of text]", "", *_sample_perf(6.5, 53, 230.0, 255, 260.0), ""])


def sample_llama_bench() -> str:
  """tools/llama-bench -o json: one object per test (json_printer)."""
  rows = []
  for fa, ts in ((0, 792.1), (1, 938.4)):
    rows.append({"build_commit": "0c1e57098", "build_number": 0, "cpu_info": "x", "gpu_info": "NVIDIA H100 80GB HBM3",
                 "backends": "CUDA", "model_filename": "/m/SmolLM2-135M-Instruct.Q4_1.gguf",
                 "model_type": "llama 135M Q4_1", "model_size": 98000000, "model_n_params": 134515008,
                 "n_batch": 2048, "n_ubatch": 512, "n_threads": 8, "n_gpu_layers": 99, "flash_attn": fa,
                 "type_k": "f16", "type_v": "f16", "n_prompt": 0, "n_gen": 256, "n_depth": 0,
                 "test_time": "2026-11-27T00:00:00Z", "avg_ns": int(256e9 / ts), "stddev_ns": 1000, "avg_ts": ts,
                 "stddev_ts": 2.5, "samples_ns": [1, 2], "samples_ts": [ts, ts]})
  body = ",\n".join("  {\n" + "".join(f'    "{k}": {json.dumps(v)},\n' for k, v in r.items() if not k.startswith("samples"))
                    + f'    "samples_ns": [ 1, 2 ],\n    "samples_ts": [ {r["avg_ts"]}, {r["avg_ts"]} ]\n  }}' for r in rows)
  return "[\n" + body + "\n]\n"


def cmd_selftest(args) -> int:
  s = parse_speculative_simple(sample_speculative_simple())
  assert (s["prompt_tokens"], s["new_tokens"], s["n_predict"], s["n_drafted"], s["n_accept"]) == (53, 257, 257, 312, 201), s
  assert abs(s["tokens_per_s"] - 257 / 0.187) < 0.01 and abs(s["decode_seconds"] - 0.187) < 1e-9, s
  assert abs(s["accept_pct"] - 64.423) < 1e-3 and abs(s["acceptance_rate"] - 201 / 312) < 1e-9, s
  assert s["stats"] == {"type": "ngram-simple", "calls_begin": 1, "calls_draft": 120, "calls_accept": 120,
                        "gen_drafts": 80, "acc_drafts": 70, "gen_tokens": 312, "acc_tokens": 201,
                        "mean_acc_len": 3.51}, s["stats"]
  assert abs(s["tau"] - 257 / 120) < 1e-9, s
  assert s["perf"]["eval_ms"] == 150.0 and s["perf"]["eval_n"] == 40 and s["perf"]["prompt_eval_n"] == 364, s["perf"]
  assert s["perf"]["load_ms"] == 812.4 and s["perf"]["total_ms"] == 420.0 and s["perf"]["sampling_ms"] == 9.5, s["perf"]
  z = parse_speculative_simple(sample_speculative_simple(n_drafted=0, n_accept=0, calls=257))
  assert z["accept_pct"] is None and "acceptance_rate" not in z and abs(z["tau"] - 1.0) < 1e-9, z
  c = parse_completion(sample_completion())
  assert c["eval_runs"] == 255 and c["prompt_tokens"] == 53 and c["end_of_text"], c
  assert abs(c["tokens_per_s"] - 255 / 0.2535) < 1e-6 and abs(c["eval_only_tokens_per_s"] - 255 / 0.230) < 1e-6, c
  b = parse_llama_bench(sample_llama_bench())
  assert [(r["flash_attn"], r["n_gen"], r["avg_ts"]) for r in b] == [(0, 256, 792.1), (1, 256, 938.4)], b
  assert b[0]["build_commit"] == "0c1e57098" and b[1]["samples_ts"] == [938.4, 938.4], b
  b2 = parse_llama_bench("ggml_cuda_init: found 1 CUDA devices\n" + sample_llama_bench())  # stray text before
  assert b2 == b
  runs = {}
  for m in LLAMA_METHODS:
    for q, tps in (("1", 1000.0), ("2", 500.0)):
      k = 2.0 if m.startswith("ngram") else 1.0
      runs[f"{m}/{q}"] = {"exit": 0, "tokens_per_s": tps * k, "new_tokens": 256, "decode_seconds": 256 / (tps * k),
                          "n_predict": 256, "n_drafted": 100, "n_accept": 50, "stats": {"calls_draft": 128}}
  summ = llama_summary(runs, [{"question_id": "1"}, {"question_id": "2"}])
  assert abs(summ["ngram_simple_n3_m8"]["speedup"] - 2.0) < 1e-9 and summ[LLAMA_PLAIN]["speedup"] == 1.0, summ
  assert abs(summ[LLAMA_PLAIN]["tokens_per_s"] - 512 / (0.256 + 0.512)) < 1e-9 and summ[LLAMA_PLAIN]["tau"] == 2.0
  if args.write:
    d = Path(args.write)
    d.mkdir(parents=True, exist_ok=True)
    (d / "speculative_simple.txt").write_text(sample_speculative_simple())
    (d / "completion.txt").write_text(sample_completion())
    (d / "llama_bench.json").write_text(sample_llama_bench())
  print("selftest: parsers ok")
  return 0


# --- running ---------------------------------------------------------------------------------------


def _read_json(path: Path, default):
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return default


def _finite(x):
  """`x` with every non-finite float replaced by None (strict JSON)."""
  if isinstance(x, float):
    return x if math.isfinite(x) else None
  if isinstance(x, dict):
    return {k: _finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_finite(v) for v in x]
  return x


def _write_json(path: Path, data) -> None:
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(_finite(data), indent=1, allow_nan=False, default=str))
  os.replace(tmp, path)


def _sha256(path: str) -> str:
  import hashlib
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _sh(cmd: list[str]) -> str | None:
  try:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None


def source_info(src: str | None) -> dict:
  """llama.cpp's provenance from SPECJAX_SOURCE.txt (written when the source was packed)."""
  info: dict = {}
  if src and (Path(src) / "SPECJAX_SOURCE.txt").is_file():
    for line in (Path(src) / "SPECJAX_SOURCE.txt").read_text().splitlines():
      if "=" in line and not line.startswith("#"):
        k, v = line.split("=", 1)
        info[k.strip()] = v.strip()
  return info


class Side:
  """The merged result, kept in STATE/RESULT and copied to OUT/RESULT after every step."""

  def __init__(self, args):
    self.args = args
    self.state = Path(args.state)
    self.state.mkdir(parents=True, exist_ok=True)
    self.out = Path(args.out) if args.out else None
    self.t_end = time.monotonic() + args.deadline_s
    self.path = self.state / RESULT
    self.data = _read_json(self.path, {})
    self.raw = self.state / "llamacpp_raw.log"

  def left(self) -> float:
    return self.t_end - time.monotonic()

  def save(self) -> None:
    _write_json(self.path, self.data)
    if self.out is not None:
      self.out.mkdir(parents=True, exist_ok=True)
      shutil.copy(self.path, self.out / RESULT)
      for extra in (self.raw, self.state / f"{SPECJAX_NAME}.json", self.state / "specjax_bench.log"):
        if extra.exists():
          shutil.copy(extra, self.out / extra.name)

  def log_raw(self, key: str, argv: list[str], rc, seconds: float, text: str) -> None:
    with open(self.raw, "a", encoding="utf-8", errors="replace") as f:
      f.write(f"\n##### {key}: exit {rc} after {seconds:.1f} s\n##### {shlex.join(argv)}\n{text}\n")


def header(args, prompts: list[dict]) -> dict:
  gguf = str(Path(args.gguf).resolve())
  git_status = _sh(["git", "status", "--porcelain", "--untracked-files=no"])
  return {
      "experiment": "llamacpp_side_by_side",
      "issue": "25 goal 5: llama.cpp built from source with CUDA, side by side with specjax in one call",
      "git_revision": os.environ.get("SPECJAX_GIT_REV") or _sh(["git", "rev-parse", "HEAD"]) or "unknown",
      "tracked_files_changed": git_status.splitlines() if git_status else [],
      "device": {"nvidia_smi": _sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                    "--format=csv,noheader"])},
      "llama_cpp": {"source": source_info(args.src), "binaries": str(Path(args.bin).resolve()) if args.bin else None,
                    "build": _read_json(Path(args.state) / "build.json", None),
                    "nvcc": ((_sh(["nvcc", "--version"]) or "").splitlines() or [None])[-1]},
      "model": {"path": gguf, "size": os.path.getsize(gguf), "sha256": _sha256(gguf)},
      **({"draft_model": {"path": str(Path(args.draft_gguf).resolve()), "size": os.path.getsize(args.draft_gguf),
                          "sha256": _sha256(args.draft_gguf)}} if args.draft_gguf else {}),
      "settings": {"batch": 1, "greedy": True, "max_new_tokens": args.max_new, "llama_cpp_common_args": COMMON,
                   "specjax_dtype": args.dtype},
      "prompts": prompts,
      "notes": NOTES,
  }


def llama_argv(args, method: str, prompt_text: str) -> list[str]:
  m = suite(args)[0][method]
  argv = [str(Path(args.bin) / m["binary"]), "-m", args.gguf, "-p", prompt_text, "-n", str(args.max_new), *COMMON,
          *m["args"]]
  if m["binary"] == "llama-speculative-simple":
    argv += SPEC_VERBOSITY
  return argv


def run_llama_bench(side: Side, args) -> None:
  d = side.data
  if d.get("llama_bench", {}).get("rows"):
    return
  argv = [str(Path(args.bin) / "llama-bench"), "-m", args.gguf, "-p", "0", "-n", str(args.max_new), "-fa", "0,1",
          "-ngl", "99", "-r", str(args.bench_reps), "-o", "json"]
  t0 = time.monotonic()
  try:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=max(10.0, min(180.0, side.left() - 5)))
    rc, stdout, stderr = p.returncode, p.stdout, p.stderr
  except subprocess.TimeoutExpired as e:
    rc, stdout, stderr = "timeout", e.stdout or "", e.stderr or ""
    stdout, stderr = (s.decode(errors="replace") if isinstance(s, bytes) else s for s in (stdout, stderr))
  side.log_raw("llama-bench", argv, rc, time.monotonic() - t0, stdout + "\n" + stderr)
  entry = {"command": argv, "exit": rc}
  try:
    entry["rows"] = parse_llama_bench(stdout)
    entry["tokens_per_s"] = {("fa_on" if r.get("flash_attn") == 1 else "fa_off"): r.get("avg_ts")
                             for r in entry["rows"]}
  except ValueError as e:
    entry["error"] = str(e)
  d["llama_bench"] = entry
  side.save()


def run_llama_prompts(side: Side, args, prompts: list[dict]) -> None:
  """Every llama.cpp method on every prompt, prompt by prompt (the methods share the drift)."""
  runs = side.data.setdefault("llama_cpp_runs", {})
  methods = suite(args)[0]
  for p in prompts:
    for method in methods:
      key = f"{method}/{p['question_id']}"
      if key in runs and runs[key].get("exit") == 0:
        continue
      if side.left() < 15:
        print(f"[side-by-side] deadline: llama.cpp stops before {key}", file=sys.stderr)
        return
      argv = llama_argv(args, method, p["text"])
      t0 = time.monotonic()
      try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, errors="replace", timeout=min(120.0, side.left() - 5))
        rc, text = r.returncode, r.stdout
      except subprocess.TimeoutExpired as e:
        rc, text = "timeout", (e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or "")
      wall = time.monotonic() - t0
      side.log_raw(key, argv, rc, wall, text)
      parsed = (parse_completion if methods[method]["binary"] == "llama-completion"
                else parse_speculative_simple)(text)
      runs[key] = {"method": method, "question_id": p["question_id"], "category": p["category"], "exit": rc,
                   "process_seconds": wall, "command": argv, **parsed}
      if parsed.get("prompt_tokens") is not None:
        runs[key]["prompt_tokens_match"] = parsed["prompt_tokens"] == p["n_tokens"]
      print(f"[side-by-side] llama.cpp {key}: exit {rc}, {parsed.get('tokens_per_s') or 0:.0f} tok/s, "
            f"{wall:.1f} s", file=sys.stderr)
      side.save()


def specjax_config(args, prompts_file: str) -> dict:
  return {"name": SPECJAX_NAME, "target": str(Path(args.gguf).resolve()), "dtype": args.dtype,
          "prompts": [str(Path(prompts_file).resolve())], "turns": 1, "max_new_tokens": args.max_new,
          "batch_size": 1, "repeats": 1, "sampling": {"temperature": 0.0},
          "methods": [m for m in suite(args)[1] if not args.specjax_methods or m["name"] in args.specjax_methods]}


def run_specjax(side: Side, args, prompts_file: str) -> None:
  import yaml
  cfg_path = side.state / "specjax_side.yaml"
  cfg_path.write_text(yaml.safe_dump(specjax_config(args, prompts_file), sort_keys=False))
  out = side.state / f"{SPECJAX_NAME}.json"
  if _read_json(out, {}).get("complete") is True:
    return
  argv = [sys.executable, "-m", "specjax.cli", "bench", "--config", str(cfg_path), "--out", str(side.state), "--resume"]
  limit = side.left() - 10
  if limit < 30:
    print("[side-by-side] deadline: no time left for specjax", file=sys.stderr)
    return
  t0 = time.monotonic()
  with open(side.state / "specjax_bench.log", "a", encoding="utf-8") as log:
    log.write(f"\n##### {shlex.join(argv)} (limit {limit:.0f} s)\n")
    log.flush()
    try:
      rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=limit).returncode
    except subprocess.TimeoutExpired:
      rc = "timeout"
  side.data.setdefault("specjax_runs", []).append(   # one entry per call; `--resume` continues the last
      {"command": argv, "config": specjax_config(args, prompts_file), "exit": rc, "limit_seconds": limit,
       "seconds": time.monotonic() - t0})
  print(f"[side-by-side] specjax bench: exit {rc} after {time.monotonic() - t0:.0f} s", file=sys.stderr)


# --- merging ---------------------------------------------------------------------------------------


def _mean(xs):
  xs = [x for x in xs if x is not None]
  return statistics.fmean(xs) if xs else None


def llama_summary(runs: dict, prompts: list[dict], methods: dict = LLAMA_METHODS) -> dict:
  """Per llama.cpp method: totals, mean per-prompt tok/s, speedup over LLAMA_PLAIN per prompt."""
  qids = [p["question_id"] for p in prompts]
  by = {m: {q: runs.get(f"{m}/{q}") for q in qids} for m in methods}
  out = {}
  for m, rows in by.items():
    ok = {q: r for q, r in rows.items() if r and r.get("exit") == 0 and r.get("tokens_per_s")}
    base = by[LLAMA_PLAIN]
    speedups = [r["tokens_per_s"] / base[q]["tokens_per_s"] for q, r in ok.items()
                if base.get(q) and base[q].get("exit") == 0 and base[q].get("tokens_per_s")]
    tokens = sum(r.get("new_tokens") or 0 for r in ok.values())
    seconds = sum(r.get("decode_seconds") or 0 for r in ok.values())
    drafted = sum(r.get("n_drafted") or 0 for r in ok.values())
    accepted = sum(r.get("n_accept") or 0 for r in ok.values())
    calls = sum((r.get("stats") or {}).get("calls_draft") or 0 for r in ok.values())
    predicted = sum(r.get("n_predict") or 0 for r in ok.values() if (r.get("stats") or {}).get("calls_draft"))
    out[m] = {"what": methods[m]["what"], "prompts": len(ok), "of": len(qids), "new_tokens": tokens,
              "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else None,
              "mean_tokens_per_s": _mean([r["tokens_per_s"] for r in ok.values()]),
              "speedup": _mean(speedups) if speedups else None,
              "acceptance_rate": accepted / drafted if drafted else None,
              "tau": predicted / calls if calls else None,
              "eval_only_tokens_per_s": _mean([r.get("eval_only_tokens_per_s") for r in ok.values()])}
  return out


def specjax_summary(result: dict) -> dict:
  out = {}
  for name, s in (result.get("summary") or {}).items():
    o = s.get("overall", {})
    out[name] = {k: o.get(k) for k in ("prompts", "new_tokens", "seconds", "tokens_per_s", "mean_tokens_per_s",
                                       "speedup", "tau", "acceptance_rate", "equal")}
  return out


def merge(side: Side, prompts: list[dict]) -> None:
  d = side.data
  methods, _, pairs = suite(side.args)
  d["llama_cpp_summary"] = llama_summary(d.get("llama_cpp_runs", {}), prompts, methods)
  sj = _read_json(side.state / f"{SPECJAX_NAME}.json", {})
  if sj:
    d["specjax"] = {"result_file": f"{SPECJAX_NAME}.json", "complete": sj.get("complete"),
                    "git_revision": sj.get("git_revision"), "device": sj.get("device"),
                    "files": sj.get("files"), "summary": specjax_summary(sj),
                    "per_prompt": {name: [{k: r.get(k) for k in ("question_id", "category", "new_tokens", "seconds",
                                                                 "rounds", "gen_tokens", "acc_tokens", "emitted",
                                                                 "equal_to_plain")} for r in rows]
                                   for name, rows in (sj.get("prompts") or {}).items()}}
  lb = (d.get("llama_bench") or {}).get("tokens_per_s") or {}
  ls, ss = d["llama_cpp_summary"], (d.get("specjax") or {}).get("summary", {})
  table = []
  for sname, lname in pairs:
    a, b = ss.get(sname) or {}, ls.get(lname) or {}
    table.append({"specjax": sname, "llama_cpp": lname,
                  "specjax_tokens_per_s": a.get("tokens_per_s"), "llama_cpp_tokens_per_s": b.get("tokens_per_s"),
                  "specjax_over_llama_cpp": (a["tokens_per_s"] / b["tokens_per_s"]
                                             if a.get("tokens_per_s") and b.get("tokens_per_s") else None),
                  "specjax_speedup": a.get("speedup"), "llama_cpp_speedup": b.get("speedup"),
                  "specjax_tau": a.get("tau"), "llama_cpp_tau": b.get("tau"),
                  "specjax_acceptance": a.get("acceptance_rate"), "llama_cpp_acceptance": b.get("acceptance_rate")})
  d["table"] = table
  d["plain_reference"] = {"llama_bench_tg256_fa_off": lb.get("fa_off"), "llama_bench_tg256_fa_on": lb.get("fa_on"),
                          "llama_completion": (ls.get("plain_completion") or {}).get("tokens_per_s"),
                          "llama_spec_loop_no_drafts": (ls.get(LLAMA_PLAIN) or {}).get("tokens_per_s"),
                          "specjax_plain": (ss.get("plain") or {}).get("tokens_per_s")}
  runs = d.get("llama_cpp_runs", {})
  d["complete"] = bool(
      (d.get("llama_bench") or {}).get("rows")
      and all(runs.get(f"{m}/{p['question_id']}", {}).get("exit") == 0 for m in methods for p in prompts)
      and (d.get("specjax") or {}).get("complete") is True)


def cmd_run(args) -> int:
  side = Side(args)
  rows = [json.loads(line) for line in open(args.prompts, encoding="utf-8") if line.strip()]
  if args.limit:
    rows = rows[: args.limit]
  tok = load_tokenizer(args.gguf)
  prompts = []
  for r in rows:
    text, ids, same = render(tok, r["turns"][0])
    prompts.append({"question_id": str(r["question_id"]), "category": r.get("category"), "n_tokens": len(ids),
                    "llama_cpp_tokenization_equal": same, "text": text})
  if args.limit:   # the specjax side reads the same prompts
    sub = side.state / "prompts_used.jsonl"
    sub.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts_file = str(sub)
  else:
    prompts_file = args.prompts
  side.data.update(header(args, prompts))
  side.data.setdefault("started", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
  side.save()
  if not args.skip_llama:
    run_llama_bench(side, args)
    run_llama_prompts(side, args, prompts)
    merge(side, prompts)
    side.save()
  if not args.skip_specjax:
    run_specjax(side, args, prompts_file)
  merge(side, prompts)
  side.data["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
  side.save()
  print(json.dumps({"complete": side.data["complete"], "table": side.data["table"],
                    "plain_reference": side.data["plain_reference"]}, indent=1))
  return 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = ap.add_subparsers(dest="cmd", required=True)
  p = sub.add_parser("prompts", help="write the prompts both sides run (JSONL)")
  p.add_argument("--out", required=True)
  p.add_argument("--source", default="mt_bench", help="prompt set name or file (default mt_bench)")
  p.add_argument("--ids", default=None, help="comma-separated question ids (default: one per category, see NOTES)")
  p.add_argument("--gguf", default=None, help="the GGUF whose tokenizer measures prompt lengths (default: the fetched SmolLM2)")
  p.set_defaults(func=cmd_prompts)
  r = sub.add_parser("run", help="run llama.cpp and specjax and merge them into STATE/OUT llamacpp_side_by_side.json")
  r.add_argument("--bin", default=None, help="llama.cpp's bin folder (llama-bench, llama-completion, llama-speculative-simple)")
  r.add_argument("--src", default=None, help="llama.cpp's source folder (SPECJAX_SOURCE.txt: version, commit)")
  r.add_argument("--gguf", required=True)
  r.add_argument("--draft-gguf", default=None,
                 help="a draft model's GGUF (same tokenizer): compare draft-model speculation instead of the n-gram grid")
  r.add_argument("--prompts", required=True)
  r.add_argument("--state", required=True, help="kept between calls: finished runs, specjax's journal")
  r.add_argument("--out", default=None, help="folder the result is copied to after every step")
  r.add_argument("--deadline-s", type=float, default=1e9, help="seconds this call may take")
  r.add_argument("--max-new", type=int, default=256)
  r.add_argument("--dtype", default="bfloat16")
  r.add_argument("--limit", type=int, default=None, help="first N prompts only (tests)")
  r.add_argument("--bench-reps", type=int, default=5)
  r.add_argument("--specjax-methods", default=None, type=lambda s: s.split(","),
                 help="comma-separated subset of the specjax methods (tests)")
  r.add_argument("--skip-llama", action="store_true")
  r.add_argument("--skip-specjax", action="store_true")
  r.set_defaults(func=cmd_run)
  q = sub.add_parser("parse", help="print what the parsers read from a saved llama.cpp output")
  q.add_argument("kind", choices=sorted(PARSERS))
  q.add_argument("file")
  q.set_defaults(func=cmd_parse)
  t = sub.add_parser("selftest", help="the parsers on outputs written with llama.cpp's own format strings")
  t.add_argument("--write", default=None, help="also write the sample outputs into this folder")
  t.set_defaults(func=cmd_selftest)
  args = ap.parse_args(argv)
  if args.cmd == "run" and not args.skip_llama and not args.bin:
    ap.error("run: --bin is required unless --skip-llama")
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
