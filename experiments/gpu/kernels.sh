#!/usr/bin/env bash
# The Pallas kernels against their XLA references, and what they buy end to end.
# Parameters: SECTION... (default: grid e2e)
#   grid     verification attention, the whole grid: context 1k/4k/16k, K 0/4/8/16, batch 1/8/32,
#            SmolLM2 and Qwen2.5-1.5B head shapes, 200 dependent calls per timed loop
#            -> $OUT/verify_attention_grid_<card>.{json,png}                       (~5 min)
#   b1split  verification attention at batch 1 (context 4k/16k, K 4/8/16): the split rule, the
#            previous rule and other split plans -> $OUT/verify_attention_b1split_<card>.{json,png}
#   e2e      SmolLM2-135M bf16, device ngram_simple n_max 8, 16 MT-bench questions, capacity 4096,
#            batch 1 / 8: every kernel off, every kernel on, attention kernel only
#            -> $OUT/verify_attention_e2e_<card>.{json,png}                        (~3.5 min; needs the weights)
#   accept   the fused accept / resample kernel vs the XLA step, batch 1-64, K 4/8/16, V 49152
#            -> $OUT/accept_sample_<card>.{json,png}
# Environment: SMOKE=1 (tiny shapes, kernels in interpret mode on a CPU); the rest as in
# bootstrap.sh (OUT required). Each section runs under its own time limit.
# Example:  OUT=/tmp/o bash experiments/gpu/kernels.sh grid e2e
source "$(dirname "$0")/bootstrap.sh"
SECTIONS=${*:-grid e2e}
if [ "${SMOKE:-0}" = 1 ]; then
  GRID=(--context 200 --k 0 4 --batch 1 --models smollm2-135m --iters 2 --repeats 1)
  B1=(--context 200 --k 4 --models smollm2-135m --iters 2 --repeats 1)
else
  GRID=(--iters 200 --repeats 5); B1=(--context 4096 16384 --k 4 8 16 --iters 200 --repeats 7)
fi
LOG="$OUT/kernels.log"
echo "[kernels] $SECTIONS, rev $SPECJAX_GIT_REV, $(device_kind)" | tee -a "$LOG"
for s in $SECTIONS; do
  case $s in
    grid) timed_run grid 400 python3 experiments/bench_verify_attention.py --out "$OUT" --tag grid "${GRID[@]}" --skip-e2e ;;
    b1split) timed_run b1split 330 python3 experiments/bench_verify_attention.py --out "$OUT" --tag b1split --batch 1 "${B1[@]}" \
               --previous-splits --split-candidates --skip-e2e --micro-budget-s 300 ;;
    e2e) timed_run e2e 300 python3 experiments/bench_verify_attention.py --out "$OUT" --tag e2e --skip-micro \
           --e2e-settings off on attention --e2e-budget-s 260 ;;
    accept) timed_run accept 150 python3 experiments/bench_accept_sample.py --out "$OUT" --budget-s 120 ;;
    *) echo "[kernels] unknown section $s (grid | b1split | e2e | accept)" ;;
  esac 2>&1 | tee -a "$LOG"
done
ls -la "$OUT"
