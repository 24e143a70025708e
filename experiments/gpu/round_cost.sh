#!/usr/bin/env bash
# The sharded round-cost rows (experiments/sharded_round_cost.py: the Llama-3.1-8B-shaped target with
# random bf16 weights and a random EAGLE-3 head) with meshes on disjoint GPUs measured at once.
# Each row compiles for ~30 s on an H100, so a machine's GPUs are split into groups that run as
# separate processes side by side: MESH_GROUPS="1:0 2:1,2" runs the one-device rows on GPU 0 while the
# model=2 rows run on GPUs 1-2 (a group: MODEL_SIZE:CUDA_VISIBLE_DEVICES). Every group resumes
# from $PERSIST/sharded_round_cost.json (an earlier call's, or carried in .gpucarry/persist) and
# measures only the rows it lacks; the groups' files are merged into $OUT/sharded_round_cost.json
# (+ .png), which is copied back to $PERSIST for the next call.
# Environment: MESH_GROUPS ["1:0 2:1,2"], ARGS [""] flags for every group (e.g. "--batches 8 64 --k 2 8
# --tree-nodes 16 64"), TIMEOUT [540] seconds for the groups (each stops starting rows 75 s before);
# the rest as in bootstrap.sh (OUT required).
# SMOKE=1: the CPU dry run (a tiny target; every group on the same 8 simulated devices).
# Example (a 4-GPU machine, two calls):
#   OUT=/tmp/o MESH_GROUPS="1:0 2:1,2" ARGS="--batches 8 64 --k 2 8 --tree-nodes 16 64" bash experiments/gpu/round_cost.sh
#   OUT=/tmp/o MESH_GROUPS="4:0,1,2,3" ARGS="--batches 1 8 64 --k 2 8 --tree-nodes 16 64" bash experiments/gpu/round_cost.sh
# NCCL allocates its buffers outside XLA's pool: at XLA's default 90 % a 4-GPU model=4 run failed
# with "Failed to allocate Scratch 1 for all-reduce" (experiments/README, "Does sharding pay?")
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.75}
source "$(dirname "$0")/bootstrap.sh"
GROUPS_=${MESH_GROUPS:-"1:0 2:1,2"}
TIMEOUT=${TIMEOUT:-540}
[ "${SMOKE:-0}" = 1 ] && SIZE="--tiny --batches 1 2 --k 1 2 --tree-nodes 4 --new-tokens 8 --prompt-len 8"
[ "${SMOKE:-0}" = 1 ] || nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || true
mkdir -p "$OUT/parts"
parts=()
for g in $GROUPS_; do
  m=${g%%:*}; gpus=${g#*:}
  part=$OUT/parts/model${m}.json
  cp "$PERSIST/sharded_round_cost.json" "$part" 2>/dev/null || true
  others=$(echo "$GROUPS_" | tr ' ' '\n' | grep -v "^$g\$" | tr '\n' ' ')
  # shellcheck disable=SC2086
  ( if [ "${SMOKE:-0}" != 1 ]; then export CUDA_VISIBLE_DEVICES=$gpus; fi
    export SPECJAX_BESIDE="$others"
    timed_run "round_cost model=$m gpus $gpus" "$TIMEOUT" python3 experiments/sharded_round_cost.py ${SIZE:-} \
      --model-sizes "$m" --budget $((TIMEOUT - 75)) --resume --out "$part" ${ARGS:-} > "$OUT/parts/model${m}.log" 2>&1
  ) &
  parts+=("$part")
done
wait
tail -n 40 "$OUT"/parts/*.log
python3 experiments/sharded_round_cost.py --merge "${parts[@]}" --out "$OUT/sharded_round_cost.json"
cp "$OUT/sharded_round_cost.json" "$PERSIST/" 2>/dev/null || true
ls -la "$OUT"
