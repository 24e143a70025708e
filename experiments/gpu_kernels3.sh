#!/usr/bin/env bash
# Issue 10 on the lent GPU, third pass.
#
#   SECTIONS="1 2" OUT=/some/dir bash experiments/gpu_kernels3.sh   # on the GPU machine, repo root
#   SMOKE=1 OUT=/tmp/k3 bash experiments/gpu_kernels3.sh             # tiny CPU run (interpret mode)
#
# 1. verification attention at batch 1, context 4k/16k, K 4/8/16, SmolLM2 and Qwen2.5-1.5B heads
#    (random bf16 inputs): XLA reference vs the kernel's split rule, the previous rule and other
#    split plans (--split-candidates), 200 dependent calls per timed loop so the host's dispatch
#    and sync (~50-100 us per loop) add < 0.5 us per call (20 calls per loop before)
#    -> $OUT/verify_attention_b1split_<card>.{json,png}                  (~4 min; no weights needed)
# 2. end to end: SmolLM2-135M bf16, device ngram_simple, n_max 8, 16 MT-bench questions, capacity
#    4096, batch 1 and 8: every kernel off, every kernel on, attention kernel only (as under auto)
#    -> $OUT/verify_attention_e2e_<card>.{json,png}                        (~3.5 min)
source "$(dirname "$0")/gpu_kernel_env.sh"
LOG="$OUT/gpu_kernels3.log"
python -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$LOG"
SECTIONS=${SECTIONS:-"1 2"}
if [ "${SMOKE:-0}" = "1" ]; then
  B1=(--context 200 --k 4 --models smollm2-135m --iters 2 --repeats 1)
else
  B1=(--context 4096 16384 --k 4 8 16 --iters 200 --repeats 7)
fi
if [[ " $SECTIONS " == *" 1 "* ]]; then
  echo "== 1. verify attention, batch 1: split plans" | tee -a "$LOG"
  timeout 330 python experiments/bench_verify_attention.py --out "$OUT" --tag b1split --batch 1 "${B1[@]}" \
    --previous-splits --split-candidates --skip-e2e --micro-budget-s 300 2>&1 | tee -a "$LOG" \
    || echo "section 1 stopped: $?" | tee -a "$LOG"
fi
if [[ " $SECTIONS " == *" 2 "* ]]; then
  echo "== 2. end to end: kernels off / on / attention only" | tee -a "$LOG"
  timeout 300 python experiments/bench_verify_attention.py --out "$OUT" --tag e2e --skip-micro \
    --e2e-settings off on attention --e2e-budget-s 260 2>&1 | tee -a "$LOG" || echo "section 2 stopped: $?" | tee -a "$LOG"
fi
ls -la "$OUT"
