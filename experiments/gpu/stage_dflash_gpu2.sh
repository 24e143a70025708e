# Issue 9, second DFlash drafter (configs/dflash_smollm2_gpu2.yaml): restores the Magpie data folders
# of stage_mtp2_data.sh from /root/persist/mtp2_data.tar (seeded from .gpucarry/persist/ on a fresh
# machine), trains for the config's train_seconds (400 s, compilation included) on them without
# building anything (--no-data), exports the drafter (bf16, 13.9 MB). ~8 minutes on an H100/H200,
# the training capped at DF_TIMEOUT (510 s). The drafter goes to /root/persist/dflash_gpu2 (read by
# stage_dflash_gpu2_eval.sh); into $OUT: the drafter, metrics.jsonl, training curve, summary, log.
#   bash experiments/gpu/stage_dflash_gpu2.sh
#   SMOKE=1 bash experiments/gpu/stage_dflash_gpu2.sh   # CPU-sized (configs/dflash_smollm2_gpu2_smoke.yaml),
#                                                      # after SMOKE=1 bash experiments/gpu/stage_mtp2_data.sh
source experiments/gpu/stage_mtp2_common.sh
if [ "${SMOKE:-0}" = 1 ]; then DF=configs/dflash_smollm2_gpu2_smoke.yaml; else DF=configs/dflash_smollm2_gpu2.yaml; fi
read -r DF_OUTDIR DF_EXPORT <<<"$(spec_fields dflash "$DF" out_dir export)"
{
  echo "[dflash gpu2] rev $SPECJAX_GIT_REV, config $DF, $(python3 -c 'import jax; print(jax.devices()[0].device_kind)')"
  [ -f "$PERSIST/mtp2_data.complete" ] || echo "[dflash gpu2] warning: $PERSIST/mtp2_data.complete missing: the data build may be partial"
  restore_data "dflash gpu2"
  timed_run "dflash gpu2" "${DF_TIMEOUT:-510}" python3 -m specjax.cli train dflash --config "$DF" --no-data --no-resume
  export_trained "dflash gpu2" "$DF_EXPORT" "$DF_OUTDIR" dflash_gpu2 dflash_gpu2_
  ls -la "$OUT"
} 2>&1 | tee "$OUT/stage_dflash_gpu2.log"
