#!/usr/bin/env bash
# The plain decode step of the Llama-3.1-8B-shaped target on model=2 (experiments/sharded_round_cost.py,
# random bf16 weights) under sets of XLA GPU options, one process each (XLA reads XLA_FLAGS once, when
# the backend starts): at batch 1 tensor parallelism lost (7.91 vs 6.35 ms on one device, 64
# all-reduces of a few KB per step), so what a collective costs besides its bytes is the question.
# Variants (NAME=FLAGS; VARIANTS overrides the list, separated by ';'):
#   default            XLA's defaults
#   one_shot           one-shot all-reduce kernels (a single kernel per small all-reduce)
#   cmdbuf_collectives collectives inside the CUDA graphs of the command buffers too
#   both               the two together
# Writes $OUT/tp_flags/NAME.json (+ .png) and prints each variant's table; MODEL_SIZE [2], BATCHES
# ["1 8"], the rest as in bootstrap.sh (OUT required). SMOKE=1: the tiny CPU target.
# Example (nvidia-h100-x2):  OUT=/tmp/o bash experiments/gpu/tp_flags.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.75}
source "$(dirname "$0")/bootstrap.sh"
VARIANTS=${VARIANTS:-"default=;one_shot=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true;cmdbuf_collectives=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES;both=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES"}
[ "${SMOKE:-0}" = 1 ] && SIZE="--tiny --new-tokens 8 --prompt-len 8" SMOKE_DEVICES=--xla_force_host_platform_device_count=8
mkdir -p "$OUT/tp_flags"
IFS=';' read -ra vs <<< "$VARIANTS"
for v in "${vs[@]}"; do
  name=${v%%=*}; flags=${v#*=}
  all=$(echo ${XLA_FLAGS:-} $flags ${SMOKE_DEVICES:-})          # words joined, no stray spaces
  # shellcheck disable=SC2086
  timed_run "tp_flags $name" "${TIMEOUT:-240}" env -u XLA_FLAGS ${all:+"XLA_FLAGS=$all"} python3 experiments/sharded_round_cost.py \
    ${SIZE:-} --model-sizes "${MODEL_SIZE:-2}" --batches ${BATCHES:-1 8} --k --tree-nodes --out "$OUT/tp_flags/$name.json" \
    | grep -v '^{' || true
done
ls -la "$OUT/tp_flags"
