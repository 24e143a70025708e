#!/usr/bin/env bash
# Sharded decoding against one device on every GPU of the machine, in one call
# (experiments/sharding_bench.py): SmolLM2 bf16 data parallel on MT-bench first turns (plain,
# ngram_simple, MTP with the committed head; global batch 8 / 64 / 32) and a Llama-3.1-8B-shaped
# target with random bf16 weights over model = 2 / 4 (batch 1 / 8). JSON + PNG into $OUT.
# Parameters: any sharding_bench.py flags (e.g. --new-tokens 256, --batches 8 64).
# Environment: TIMEOUT [510] seconds (hard limit of both scripts together; the JSONs keep every
# finished row), BUDGET [its share of TIMEOUT - 90] seconds after which no new row starts, MTP_HEAD [the committed head, else
# $PERSIST/heads/mtp/mtp_head.safetensors]; the rest as in bootstrap.sh (OUT required).
# SMOKE=1: the CPU dry run (tiny random targets, 8 simulated devices, 8 new tokens).
# Then experiments/sharded_round_cost.py (the same 8B-shaped target with a random EAGLE-3 head: ms
# per plain step, per chain round vs K, per eagle3_tree round vs nodes; model = 1 / 2 / 4, batch
# 1 / 8 / 64) into $OUT/sharded_round_cost.json(.png), under a timeout of what is left of TIMEOUT:
# ROUND_COST_S [200] seconds kept for it out of TIMEOUT (0: not run), ROUND_COST_ONLY=1 (it alone,
# all of TIMEOUT), ROUND_COST_ARGS [""] its flags (e.g. "--batches 64 --k 4"), ROUND_COST_RESUME=1
# (start from $PERSIST/sharded_round_cost.json, from an earlier call on this machine or carried in
# .gpucarry/persist, and measure only the rows it lacks; the file is copied back to $PERSIST).
# Example (a 2-GPU machine):  OUT=/tmp/o bash experiments/gpu/sharding.sh
# NCCL allocates its buffers outside XLA's pool: at XLA's default 90 % a 4-GPU model=4 run failed
# with "Failed to allocate Scratch 1 for all-reduce" (experiments/README, "Does sharding pay?")
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.75}
source "$(dirname "$0")/bootstrap.sh"
TIMEOUT=${TIMEOUT:-510}
T0=$(date +%s)
ROUND_COST_S=${ROUND_COST_S:-200}
[ "${ROUND_COST_ONLY:-0}" = 1 ] && ROUND_COST_S=$TIMEOUT
BENCH_TIMEOUT=$((TIMEOUT - ROUND_COST_S))
BUDGET=${BUDGET:-$((BENCH_TIMEOUT - 90))}
if [ "${SMOKE:-0}" = 1 ]; then
  SIZE="--tiny --data 2 --batches 2 4 --mp-batches 1 2 --new-tokens 8"
  ROUND_SIZE="--tiny --batches 1 2 --k 1 2 --tree-nodes 4 --new-tokens 8 --prompt-len 8"
else
  MTP_HEAD=${MTP_HEAD:-assets/smollm2/mtp/mtp_head.safetensors}
  [ -f "$MTP_HEAD" ] || MTP_HEAD=$PERSIST/heads/mtp/mtp_head.safetensors
  SIZE="--mtp-head $MTP_HEAD"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi
echo "[sharding] $(python3 -c 'import jax; print(jax.device_count(), "x", jax.devices()[0].device_kind)')"
if [ "$BENCH_TIMEOUT" -gt 0 ]; then
  # shellcheck disable=SC2086
  timed_run sharding "$BENCH_TIMEOUT" python3 experiments/sharding_bench.py $SIZE --budget "$BUDGET" --out "$OUT/sharding.json" "$@"
  python3 experiments/sharding_bench.py --plot-only --out "$OUT/sharding.json" || true
fi
LEFT=$((TIMEOUT - ($(date +%s) - T0)))
if [ "$ROUND_COST_S" -gt 0 ] && [ "$LEFT" -gt 90 ]; then
  RC=$OUT/sharded_round_cost.json
  if [ "${ROUND_COST_RESUME:-0}" = 1 ]; then cp "$PERSIST/sharded_round_cost.json" "$RC" 2>/dev/null || true; fi
  # shellcheck disable=SC2086
  timed_run round_cost "$LEFT" python3 experiments/sharded_round_cost.py ${ROUND_SIZE:-} --budget $((LEFT - 75)) \
    --resume --out "$RC" ${ROUND_COST_ARGS:-}
  python3 experiments/sharded_round_cost.py --plot-only --out "$RC" || true
  cp "$RC" "$PERSIST/" 2>/dev/null || true
else
  echo "[round_cost] not run: ROUND_COST_S=$ROUND_COST_S, ${LEFT} s left"
fi
ls -la "$OUT"
