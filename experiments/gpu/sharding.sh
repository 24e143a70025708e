#!/usr/bin/env bash
# Sharded decoding against one device on every GPU of the machine, in one call
# (experiments/sharding_bench.py): SmolLM2 bf16 data parallel on MT-bench first turns (plain,
# ngram_simple, MTP with the committed head; global batch 8 / 64 / 32) and a Llama-3.1-8B-shaped
# target with random bf16 weights over model = 2 / 4 (batch 1 / 8). JSON + PNG into $OUT.
# Parameters: any sharding_bench.py flags (e.g. --new-tokens 256, --batches 8 64).
# Environment: TIMEOUT [510] seconds (hard limit; the JSON keeps every finished row), BUDGET
# [TIMEOUT - 90] seconds after which no new row starts, MTP_HEAD [the committed head, else
# $PERSIST/heads/mtp/mtp_head.safetensors]; the rest as in bootstrap.sh (OUT required).
# SMOKE=1: the CPU dry run (tiny random targets, 8 simulated devices, 8 new tokens).
# Example (a 2-GPU machine):  OUT=/tmp/o bash experiments/gpu/sharding.sh
source "$(dirname "$0")/bootstrap.sh"
TIMEOUT=${TIMEOUT:-510}
BUDGET=${BUDGET:-$((TIMEOUT - 90))}
if [ "${SMOKE:-0}" = 1 ]; then
  SIZE="--tiny --data 2 --batches 2 4 --mp-batches 1 2 --new-tokens 8"
else
  MTP_HEAD=${MTP_HEAD:-assets/smollm2/mtp/mtp_head.safetensors}
  [ -f "$MTP_HEAD" ] || MTP_HEAD=$PERSIST/heads/mtp/mtp_head.safetensors
  SIZE="--mtp-head $MTP_HEAD"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi
echo "[sharding] $(python3 -c 'import jax; print(jax.device_count(), "x", jax.devices()[0].device_kind)')"
# shellcheck disable=SC2086
timed_run sharding "$TIMEOUT" python3 experiments/sharding_bench.py $SIZE --budget "$BUDGET" --out "$OUT/sharding.json" "$@"
python3 experiments/sharding_bench.py --plot-only --out "$OUT/sharding.json" || true
ls -la "$OUT"
