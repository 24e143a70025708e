"""Where the wall time of one batch goes outside the decode loop (issue 11 diagnosis): prefill,
loop and output read-back timed separately for plain decoding and fixed n_max 2 (device
ngram_simple), SmolLM2 bf16, the first MT-bench questions at one batch size.

  python experiments/profile_overhead.py --batch 64 --out $OUT
"""
import argparse, json, sys, time
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.engine import decode
from specjax.engine.loops import device_loop, prefill_request
from specjax.engine.round import RoundInputs, RoundSpec
from specjax.bench.env import device_info, git_revision
from specjax.bench.prompts import load_prompt_set
from specjax.drafters.base import DraftParams
from specjax.drafters.registry import make_speculator
from specjax.engine.generation import outputs_of, pad_prompts, plan_capacity
from specjax.models.load import load_model
from specjax.engine.sampling import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--capacity", type=int, default=1024)
ap.add_argument("--max-new", type=int, default=128)
ap.add_argument("--out", default=".")
a = ap.parse_args()
t = load_model("smollm2-135m-instruct", dtype=jnp.bfloat16, progress=False)
tok = t.tokenizer
qs = load_prompt_set("mt_bench", limit=a.batch)
prompts = [tok.encode_chat([{"role": "user", "content": q.turns[0]}]) for q in qs]
tokens, lens = pad_prompts(prompts)
b = len(prompts)
stop = jnp.asarray(list(tok.eos_ids), jnp.int32)
max_new = jnp.full((b,), a.max_new, jnp.int32)
rows = []
for name in ("plain", "fixed_n2"):
  for rep in range(3):
    sampling = SamplingParams.make(b, temperature=0.0)
    t0 = time.perf_counter()
    if name == "plain":
      cap = plan_capacity(tokens.shape[1], a.max_new, 0, a.capacity)
      inp = RoundInputs(params=t.params, dparams=(), sampling=sampling, dp={}, stop_ids=stop, max_new=max_new)
      st = prefill_request(RoundSpec(cfg=t.cfg), inp, jnp.asarray(tokens), jnp.asarray(lens), capacity=cap,
                           history_len=cap).state
      jax.block_until_ready(st.hist_len); t1 = time.perf_counter()
      st = decode._decode_loop(t.params, st, sampling, stop, max_new, cfg=t.cfg)
    else:
      dp0 = DraftParams(n_max=2)
      d = make_speculator("ngram_simple", t, draft_params=dp0, options={"size_n": 2, "size_m": 8})
      k = d.max_draft
      dp = {n: jnp.asarray(x) for n, x in dp0.arrays(b, k).items()}
      cap = plan_capacity(tokens.shape[1], a.max_new, k + 1, a.capacity)
      spec = RoundSpec(cfg=t.cfg, drafter=d)
      inp = RoundInputs(params=t.params, dparams=d.params(), sampling=sampling, dp=dp, stop_ids=stop, max_new=max_new)
      carry = prefill_request(spec, inp, jnp.asarray(tokens), jnp.asarray(lens), capacity=cap, history_len=cap)
      jax.block_until_ready(carry.state.hist_len); t1 = time.perf_counter()
      st = device_loop(spec, inp, carry).state
    jax.block_until_ready(st.hist_len); t2 = time.perf_counter()
    outs = outputs_of(st); t3 = time.perf_counter()
    rows.append({"method": name, "rep": rep, "prefill_ms": 1e3 * (t1 - t0), "loop_ms": 1e3 * (t2 - t1),
                 "outputs_ms": 1e3 * (t3 - t2), "tokens": sum(map(len, outs)), "prompt_width": int(tokens.shape[1])})
    print(rows[-1], flush=True)
res = {"experiment": "profile_overhead", "config": vars(a), "git_revision": git_revision(), "device": device_info(),
       "rows": rows}
Path(a.out, f"profile_overhead_b{a.batch}.json").write_text(json.dumps(res, indent=1))
