#!/usr/bin/env bash
# Issue 10 on the lent GPU, second pass: the batch-1 split rule of the verification-attention
# kernel, the accept / resample kernel, and end-to-end tokens/s with every kernel on vs off.
#
#   OUT=/some/dir bash experiments/gpu_kernels2.sh          # on the GPU machine, from the repo root
#   SMOKE=1 OUT=/tmp/k2 bash experiments/gpu_kernels2.sh    # tiny CPU run (kernels in interpret mode)
#
# 1. verify attention at batch 1 (context 4k/16k, K 4/8/16, SmolLM2 and Qwen2.5-1.5B heads):
#    XLA reference, the kernel with the new split rule, and the kernel with the previous one
#    -> $OUT/verify_attention_b1_<card>.{json,png}                          (~1.5 min)
# 2. accept / resample: kernel vs XLA (batch 1/8/32/64, K 4/8/16, V 49152; f32 p with and without
#    q, bf16 p with q) -> $OUT/accept_sample_<card>.{json,png}               (~2 min)
# 3. end to end: SmolLM2-135M bf16, device ngram_simple, n_max 8, 16 MT-bench questions, capacity
#    4096, batch 1 and 8: every kernel off, every kernel on (auto), attention kernel only
#    -> $OUT/verify_attention_e2e_<card>.{json,png}                         (~3.5 min)
# Log: $OUT/gpu_kernels2.log. Each section has its own time limit, so the whole stays under 8 min.
source "$(dirname "$0")/gpu_kernel_env.sh"
LOG="$OUT/gpu_kernels2.log"
python -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$LOG"

if [ "${SMOKE:-0}" = "1" ]; then
  B1=(--context 200 --k 4 8 --models smollm2-135m)
else
  B1=(--context 4096 16384 --k 4 8 16)
fi
echo "== 1. verify attention, batch 1: new vs previous split rule" | tee -a "$LOG"
timeout 100 python experiments/bench_verify_attention.py --out "$OUT" --tag b1 --batch 1 "${B1[@]}" \
  --previous-splits --skip-e2e --micro-budget-s 75 2>&1 | tee -a "$LOG" || echo "section 1 stopped: $?" | tee -a "$LOG"

echo "== 2. accept / resample kernel" | tee -a "$LOG"
timeout 150 python experiments/bench_accept_sample.py --out "$OUT" --budget-s 120 2>&1 | tee -a "$LOG" \
  || echo "section 2 stopped: $?" | tee -a "$LOG"

echo "== 3. end to end: kernels off / on / attention only" | tee -a "$LOG"
timeout 215 python experiments/bench_verify_attention.py --out "$OUT" --tag e2e --skip-micro \
  --e2e-settings off on attention --e2e-budget-s 160 2>&1 | tee -a "$LOG" || echo "section 3 stopped: $?" | tee -a "$LOG"
ls -la "$OUT"
