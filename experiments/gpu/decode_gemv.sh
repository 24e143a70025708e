#!/usr/bin/env bash
# The one-row product input barrier (`specjax.models.layers.matmul_input`) on and off, side by side
# in one call: the plain decode step's kernels per layer and ms per step at batch 1 / 8 (decode_flags,
# SmolLM2's shapes with random weights, the default XLA options) under SPECJAX_GEMV_BARRIER=1 and =0,
# the profiler trace of the step with the barrier on (kernel by kernel, as results/decode_profile_h200
# has it without), and, where SmolLM2's weights are installed, `bench_decode.py` at batch 1 / 8 with
# MT-bench prompts under both. Writes $OUT/decode_flags_gemv{1,0}.json, $OUT/decode_trace_gemv.{json,png}
# and $OUT/decode_gemv{1,0}.json. Environment as in bootstrap.sh (OUT required); SMOKE=1: the tiny
# CPU target, a dry run of the script.
# Example:  OUT=/tmp/o bash experiments/gpu/decode_gemv.sh
source "$(dirname "$0")/bootstrap.sh"
if [ "${SMOKE:-0}" = 1 ]; then
  SHAPE=(--tiny --batch 1 --new-tokens 4 --repeats 1); TRACE=(--tiny --batch 1 --new-tokens 4)
else
  SHAPE=(--random-shape); TRACE=(--random-shape)
fi
echo "[decode-gemv] rev $SPECJAX_GIT_REV on $(device_kind)"
for g in 1 0; do
  SPECJAX_GEMV_BARRIER=$g timed_run "decode_flags gemv=$g" 240 python3 experiments/decode_flags.py "${SHAPE[@]}" \
    --variants default --out "$OUT/decode_flags_gemv$g.json"
done
SPECJAX_GEMV_BARRIER=1 timed_run "trace gemv=1" 200 python3 experiments/profile_decode_trace.py "${TRACE[@]}" \
  --out "$OUT/decode_trace_gemv.json"
if [ "${SMOKE:-0}" != 1 ] && [ -f "$SPECJAX_HOME/.$MODEL" ]; then
  for g in 1 0; do
    SPECJAX_GEMV_BARRIER=$g timed_run "bench_decode gemv=$g" 200 python3 experiments/bench_decode.py --batch 1 8 \
      --repeats 3 --prompts "$SPECJAX_DATA/mt_bench_question.jsonl" --out "$OUT/decode_gemv$g.json"
  done
fi
ls -la "$OUT"
