# Optional: an EAGLE-3 head on the same data as the second MTP head (configs/eagle3_smollm2_gpu2.yaml,
# whose data sections are configs/mtp_smollm2_gpu2.yaml's): restores the folders of
# stage_mtp2_data.sh from /root/persist, trains with the training-time test for time_budget_s (300 s
# after compilation), exports. ~6.5 minutes on an H200, capped at E3_TIMEOUT (450 s). The head goes
# to /root/persist/eagle3_gpu2; into $OUT: the head, metrics.jsonl, training curve, summary, the log.
#   bash experiments/gpu/stage_mtp2_eagle3.sh
#   SMOKE=1 bash experiments/gpu/stage_mtp2_eagle3.sh   # CPU-sized (configs/eagle3_smollm2_gpu2_smoke.yaml)
source experiments/gpu/stage_mtp2_common.sh
if [ "${SMOKE:-0}" = 1 ]; then E3=configs/eagle3_smollm2_gpu2_smoke.yaml; else E3=configs/eagle3_smollm2_gpu2.yaml; fi
read -r E3_OUTDIR E3_EXPORT <<<"$(spec_fields eagle3 "$E3" out_dir export)"
{
  echo "[mtp2 eagle3] rev $SPECJAX_GIT_REV, config $E3, $(python3 -c 'import jax; print(jax.devices()[0].device_kind)')"
  restore_data "mtp2 eagle3"
  timed_run "mtp2 eagle3" "${E3_TIMEOUT:-450}" python3 -m specjax.cli train eagle3 --config "$E3" --no-resume
  export_trained "mtp2 eagle3" "$E3_EXPORT" "$E3_OUTDIR" eagle3_gpu2 eagle3_gpu2_
  ls -la "$OUT"
} 2>&1 | tee "$OUT/stage_mtp2_eagle3.log"
