#!/usr/bin/env bash
# Two bench-serve configs at once on a 2-GPU machine (nvidia-h200-x2 / h100-x2): CONFIG_A on GPU 0,
# CONFIG_B on GPU 1, the same METHODS, each with plain decoding beside it (experiments/gpu/bench_serve.sh
# each). The machine is set up once (bootstrap.sh) before either starts; the script waits for both.
# Writes $OUT/a/ and $OUT/b/ (each config's JSON + PNG and log.txt) and prints both logs.
# Environment: CONFIG_A [configs/bench_serve_smollm2.yaml], CONFIG_B
# [configs/bench_serve_smollm2_call_budget.yaml], METHODS, TIMEOUT as in bench_serve.sh; the heads the
# methods name must be under assets/ (carry them, or once as .gpucarry/persist/assets/..., see
# bootstrap.sh). Further arguments go to both `specjax bench-serve` runs.
# Example:  OUT=/tmp/o METHODS=dflash_tree_32_adaptive,mtp_n3_adaptive bash experiments/gpu/bench_serve_pair.sh
source "$(dirname "$0")/bootstrap.sh"
mkdir -p "$OUT/a" "$OUT/b"
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a CONFIG=${CONFIG_A:-configs/bench_serve_smollm2.yaml} \
  bash experiments/gpu/bench_serve.sh "$@" > "$OUT/a/log.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b CONFIG=${CONFIG_B:-configs/bench_serve_smollm2_call_budget.yaml} \
  bash experiments/gpu/bench_serve.sh "$@" > "$OUT/b/log.txt" 2>&1 &
wait
cat "$OUT/a/log.txt" "$OUT/b/log.txt"
