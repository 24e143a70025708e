#!/usr/bin/env bash
# EAGLE-3 head for SmolLM2-135M-Instruct on one GPU (issue 8), ~8 minutes on an H200:
#   1. self-distillation data (the target's greedy answers to gsm8k / alpaca / humaneval, sampled
#      answers to alpaca / humaneval, reference answers) and training with the training-time test,
#      steps capped to ~180 s after compilation (configs/eagle3_smollm2.yaml; data + training <= 6 min);
#   2. MT-bench (first 16 questions, first turn, 128 new tokens, batch 8): tau and acceptance by
#      position for chains (n_max 1..5) and by depth for EAGLE-2 trees (depth 6, top-k 8, 48 nodes),
#      greedy and temperature 0.7, tokens/s against plain decoding and the MTP head in the same process.
# Into $OUT: the head (bf16 safetensors + json), metrics.jsonl, training curve, training summary,
# eval JSON + PNG (config, git revision, device inside), the log.
#
#   OUT=/tmp/out bash experiments/gpu_eagle3.sh            # GPU (PYTHONPATH, SPECJAX_HOME, SPECJAX_DATA set)
#   SMOKE=1 OUT=/tmp/e3 bash experiments/gpu_eagle3.sh     # the same pipeline, CPU-sized (~5 minutes)
set -euo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:-$PWD}
export SPECJAX_GIT_REV=${SPECJAX_GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
: "${OUT:?set OUT to the folder whose files come back}"
mkdir -p "$OUT"
LOG="$OUT/gpu_eagle3.log"
if [ "${SMOKE:-0}" = 1 ]; then
  CFG=configs/eagle3_smollm2_smoke.yaml
  EVAL=(--n-questions 2 --batch-size 2 --max-new-tokens 16 --n-max 1,2 --tree 3,2,5)
  EVAL_TIMEOUT=400
else
  CFG=configs/eagle3_smollm2.yaml
  EVAL=(--n-questions 16 --batch-size 8 --max-new-tokens 128 --n-max 1,2,3,4,5 --tree 6,8,48)
  EVAL_TIMEOUT=${EVAL_TIMEOUT:-170}
fi
MTP=assets/mtp_smollm2_gpu/mtp_head.safetensors
[ -f "$MTP" ] || MTP=assets/mtp_smollm2_gpu/mtp_head.safetensors
OUTDIR=$(python3 -c "import yaml; print(yaml.safe_load(open('$CFG'))['out_dir'])")
EXPORT=$(python3 -c "import yaml; print(yaml.safe_load(open('$CFG'))['export'])")
{
  echo "[gpu_eagle3] rev $SPECJAX_GIT_REV, config $CFG, $(python3 -c 'import jax; print(jax.devices()[0].device_kind)')"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
  rm -rf "$OUTDIR/checkpoints" "$OUTDIR/plan.json" "$OUTDIR/d2t.npy"        # datasets are kept (resumable)
  t0=$(date +%s)
  python3 -m specjax.cli train eagle3 --config "$CFG" --no-resume 2>&1 | tr '\r' '\n' | grep -v "it/s\|s/it\|seq/s" || true
  echo "[gpu_eagle3] data + training: $(( $(date +%s) - t0 )) s"
  cp "$EXPORT" "$OUT/" && cp "${EXPORT%.safetensors}.json" "$OUT/"
  cp "$OUTDIR/metrics.jsonl" "$OUTDIR/training_curve.png" "$OUT/"
  cp "$OUTDIR/summary.json" "$OUT/eagle3_train_summary.json"
  t0=$(date +%s)
  timeout "$EVAL_TIMEOUT" python3 -m specjax.cli train eval-eagle3 --config "$CFG" --head "$EXPORT" "${EVAL[@]}" \
    --mtp-head "$MTP" --out "$OUT/eagle3_eval_mt_bench.json" 2>&1 | tr '\r' '\n' | grep -v "it/s\|s/it" \
    || echo "[gpu_eagle3] evaluation stopped (timeout $EVAL_TIMEOUT s): partial results kept"
  [ -f "$OUT/eagle3_eval_mt_bench.png" ] || python3 -c "
import json, sys
from specjax.train.eagle3_eval import plot_eval
res = json.load(open('$OUT/eagle3_eval_mt_bench.json')); res['partial'] = True
plot_eval(res, '$OUT/eagle3_eval_mt_bench.png')" || true
  echo "[gpu_eagle3] evaluation: $(( $(date +%s) - t0 )) s"
  ls -la "$OUT"
} 2>&1 | tee "$LOG"
