# Issue 7, second MTP head, call 3 of 3 (run twice: `greedy`, then `t07`): the head of
# stage_mtp2_train.sh (from /root/persist/mtp2, copied to assets/mtp_smollm2_gpu2) on all 80 MT-bench
# first turns, 256 new tokens, n_max 1..4 and plain decoding in the same process:
# configs/mtp_smollm2_gpu2_mt_bench_{greedy,t07}.yaml, ~6 minutes each on an H200 (40 prompts took
# ~190 s in session 2), capped at EVAL_TIMEOUT (540 s). Into $OUT: the bench JSON + PNG, the log.
#   bash experiments/gpu/stage_mtp2_eval.sh greedy      # GPU, temperature 0
#   bash experiments/gpu/stage_mtp2_eval.sh t07         # GPU, temperature 0.7
#   EVAL_LIMIT=40 bash experiments/gpu/stage_mtp2_eval.sh t07   # first 40 questions only (~3 min)
#   SMOKE=1 bash experiments/gpu/stage_mtp2_eval.sh     # CPU-sized (configs/mtp_smollm2_gpu2_smoke_bench.yaml)
PART=${1:-greedy}
source experiments/gpu/stage_mtp2_common.sh
case "$PART" in greedy|t07) ;; *) echo "usage: stage_mtp2_eval.sh greedy|t07"; exit 2;; esac
if [ "${SMOKE:-0}" = 1 ]; then
  BENCH=configs/mtp_smollm2_gpu2_smoke_bench.yaml
else
  BENCH=configs/mtp_smollm2_gpu2_mt_bench_$PART.yaml
  [ -f "$PERSIST/mtp2/mtp_head.safetensors" ] || { echo "[mtp2 eval] no head in $PERSIST/mtp2: run stage_mtp2_train.sh"; exit 1; }
  mkdir -p assets/mtp_smollm2_gpu2 && cp "$PERSIST"/mtp2/mtp_head.* assets/mtp_smollm2_gpu2/
fi
{
  echo "[mtp2 eval] rev $SPECJAX_GIT_REV, $BENCH, $(python3 -c 'import jax; print(jax.devices()[0].device_kind)')"
  t0=$(date +%s)
  timeout "${EVAL_TIMEOUT:-540}" python3 -m specjax.cli bench --config "$BENCH" ${EVAL_LIMIT:+--limit $EVAL_LIMIT} --out "$OUT" 2>&1 | bars \
    || echo "[mtp2 eval] bench failed or timed out"
  echo "[mtp2 eval] $(( $(date +%s) - t0 )) s"
  ls -la "$OUT"
} 2>&1 | tee "$OUT/stage_mtp2_eval_$PART.log"
