#!/usr/bin/env bash
# Issue 10, item 2 on the lent GPU: the Pallas verification-attention kernel against the XLA
# reference (context 1k/4k/16k, K 0/4/8/16, batch 1/8/32; SmolLM2 and Qwen2.5-1.5B head shapes),
# then end-to-end speculative decoding tokens/s with and without it (SmolLM2-135M bf16, device
# ngram_simple, n_max 8, 16 MT-bench questions, batch 1 and 8, capacity 4096), in one process.
#
#   OUT=/some/dir bash experiments/gpu_kernels.sh          # on the GPU machine, from the repo root
#   SMOKE=1 OUT=/tmp/va bash experiments/gpu_kernels.sh    # tiny CPU run (kernel in interpret mode)
#
# Writes $OUT/verify_attention_<card>.{json,png} (partial JSON after each section) and the log.
# Wall time: ~3.5 min kernel timings + ~3.5 min end to end (each section has a time budget).
source "$(dirname "$0")/gpu_kernel_env.sh"
python -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout 470 python experiments/bench_verify_attention.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_kernels.log"
