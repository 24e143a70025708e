# Issue 7, second MTP head, call 2 of 3: restores the data of stage_mtp2_data.sh from /root/persist
# (finishing it first if that call timed out), trains the head of configs/mtp_smollm2_gpu2.yaml
# (3300 steps, ~5.5 minutes on an H200) under TRAIN_TIMEOUT (390 s), exports it. The head goes to
# /root/persist/mtp2 for stage_mtp2_eval.sh; checkpoints to /root/persist/mtp2_ckpt.tar (a run cut by
# the timeout resumes from them when this script runs again). Into $OUT: the head (bf16 safetensors
# + json), metrics.jsonl, training curve, training summary, the log.
#   bash experiments/gpu/stage_mtp2_train.sh            # GPU
#   SMOKE=1 bash experiments/gpu/stage_mtp2_train.sh    # CPU-sized
source experiments/gpu/stage_mtp2_common.sh
{
  echo "[mtp2 train] rev $SPECJAX_GIT_REV, config $CFG, $(python3 -c 'import jax; print(jax.devices()[0].device_kind)')"
  [ -f "$PERSIST/mtp2_data.tar" ] || { echo "[mtp2 train] no $PERSIST/mtp2_data.tar: run stage_mtp2_data.sh first"; exit 1; }
  tar xf "$PERSIST/mtp2_data.tar"
  [ -f "$PERSIST/mtp2_ckpt.tar" ] && tar xf "$PERSIST/mtp2_ckpt.tar" && echo "[mtp2 train] checkpoints restored"
  set +e
  if [ ! -f "$PERSIST/mtp2_data.complete" ]; then
    t0=$(date +%s)
    timeout "${DATA_TIMEOUT:-150}" python3 -m specjax.cli train data --config "$CFG" --quiet
    rc=$?
    echo "[mtp2 train] data finished here (exit $rc) in $(( $(date +%s) - t0 )) s"
    persist_data
    [ "$rc" = 0 ] && touch "$PERSIST/mtp2_data.complete"
  fi
  t0=$(date +%s)
  timeout "${TRAIN_TIMEOUT:-390}" python3 -m specjax.cli train mtp --config "$CFG" 2>&1 | bars
  rc=${PIPESTATUS[0]}
  set -e
  echo "[mtp2 train] exit $rc after $(( $(date +%s) - t0 )) s"
  [ -d "$OUTDIR/checkpoints" ] && tar cf "$PERSIST/mtp2_ckpt.tar" "$OUTDIR/checkpoints" "$OUTDIR/metrics.jsonl"
  if [ -f "$EXPORT" ]; then
    mkdir -p "$PERSIST/mtp2" && cp "${EXPORT%.safetensors}".* "$PERSIST/mtp2/"
    cp "${EXPORT%.safetensors}".* "$OUT/"
  else
    echo "[mtp2 train] no export yet (training stopped early; run this stage again to resume)"
  fi
  for f in metrics.jsonl training_curve.png; do [ -f "$OUTDIR/$f" ] && cp "$OUTDIR/$f" "$OUT/"; done
  [ -f "$OUTDIR/summary.json" ] && cp "$OUTDIR/summary.json" "$OUT/mtp2_train_summary.json"
  ls -la "$OUT"
} 2>&1 | tee "$OUT/stage_mtp2_train.log"
