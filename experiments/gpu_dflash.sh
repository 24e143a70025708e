#!/usr/bin/env bash
# DFlash drafter for SmolLM2-135M-Instruct (issue 9), end to end on one GPU (H200/H100, bf16):
#   1. self-distillation data: the target's greedy answers to Alpaca / GSM8K / HumanEval prompts (minus
#      the 16 HumanEval evaluation prompts) plus sampled answers to the chat / code prompts, grown for
#      DATA_S seconds; then training for TRAIN_S seconds (steps fitted after timing the first ones);
#   2. export: bf16 safetensors + JSON config, training curve, training summary -> $OUT;
#   3. evaluation: MT-bench (first 16 questions, first turn) and HumanEval (first 16 prompts), 128 new
#      tokens, batch 8, greedy and temperature 0.7: tau, acceptance by position, tokens/s of DFlash and
#      of the committed MTP head vs plain decoding in the same process -> $OUT/dflash_eval.{json,png}.
#
#   OUT=/tmp/out bash experiments/gpu_dflash.sh            # on the GPU machine (~7.5 min with compilation)
#   (DATA_S / TRAIN_S / EVAL_S seconds: 90 / 150 / 250 by default; NO_MTP=1 leaves out the MTP comparison)
#   SMOKE=1 OUT=/tmp/dflash_smoke bash experiments/gpu_dflash.sh   # tiny CPU check of the whole pipeline
#
# Expects (the GPU machine sets them): PYTHONPATH with jax/flax/etc., SPECJAX_HOME holding
# smollm2-135m-instruct, SPECJAX_DATA holding the four jsonl prompt files, SPECJAX_GIT_REV.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder whose files come back}"
export PYTHONUNBUFFERED=1
export SPECJAX_GIT_REV=${SPECJAX_GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"

if [ "${SMOKE:-0}" = 1 ]; then
  CONFIG=configs/dflash_smollm2_smoke.yaml; DTYPE=float32; DATA_S=20; TRAIN_S=60; WORK=out/dflash_smoke
  EVAL="--n-questions 2 --max-new-tokens 16 --batch-size 2"
else
  CONFIG=configs/dflash_smollm2.yaml; DTYPE=bfloat16; DATA_S=${DATA_S:-90}; TRAIN_S=${TRAIN_S:-150}; WORK=out/dflash_smollm2
  EVAL="--n-questions 16 --max-new-tokens 128 --batch-size 8"
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
mkdir -p "$WORK"

# HumanEval without its first 16 prompts (the evaluation prompts), written at run time, never committed
python3 - "$WORK/humaneval_train.jsonl" <<'PY'
import sys
from specjax.bench.prompts import resolve
lines = [ln for ln in open(resolve("humaneval")) if ln.strip()]
open(sys.argv[1], "w").writelines(lines[16:])
print(f"[gpu_dflash] {len(lines) - 16} HumanEval training prompts (first 16 held out for evaluation)")
PY

t0=$(date +%s)
python3 -m specjax.cli train dflash --config "$CONFIG" --dtype "$DTYPE" --data-seconds "$DATA_S" \
  --train-seconds "$TRAIN_S" --no-resume --quiet
t1=$(date +%s)
echo "[gpu_dflash] data + training: $((t1 - t0)) s"
cp "$WORK/export/dflash.safetensors" "$WORK/export/dflash.json" "$WORK/training_curve.png" "$OUT/"
cp "$WORK/summary.json" "$OUT/train_summary.json"

MTP=assets/mtp_smollm2_gpu/mtp_head.safetensors
[ -f "$MTP" ] || MTP=assets/mtp_smollm2_gpu/mtp_head.safetensors
EAGLE3=${EAGLE3_HEAD:-assets/eagle3_smollm2/eagle3_head.safetensors}   # side by side when present
# the JSON and PNG are rewritten after each prompt set: a run cut short keeps MT-bench
timeout "${EVAL_S:-250}" python3 -m specjax.cli train eval-dflash --config "$CONFIG" --dtype "$DTYPE" \
  --head "$WORK/export/dflash.safetensors" --prompts mt_bench,humaneval --temperatures 0,0.7 --n-max 15 $EVAL \
  $([ -f "$MTP" ] && [ "${NO_MTP:-0}" != 1 ] && echo "--mtp-head $MTP") \
  $([ -f "$EAGLE3" ] && echo "--eagle3-head $EAGLE3") --out "$OUT/dflash_eval.json" --quiet \
  || echo "[gpu_dflash] evaluation stopped early (exit $?); results so far are in $OUT"
echo "[gpu_dflash] evaluation: $(( $(date +%s) - t1 )) s"
ls -la "$OUT"
