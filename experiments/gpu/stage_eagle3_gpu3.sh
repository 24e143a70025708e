# Issue 8, third EAGLE-3 head (configs/eagle3_smollm2_gpu3.yaml): restores the second MTP head's data
# folders from /root/persist/mtp2_data.tar (stage_mtp2_data.sh; carry it in .gpucarry/persist/ on a
# fresh machine), starts from the second EAGLE-3 head (assets/eagle3_smollm2_gpu2, carried, or
# /root/persist/eagle3_gpu2), generates a held-out Magpie folder and new Magpie folders while
# data_budget_s (170 s) allows, trains for what is left of wall_budget_s (490 s), scores the head on
# held-out and training rows, exports. One call, capped at E3_TIMEOUT (545 s; ~9 minutes with the
# setup). The head goes to /root/persist/eagle3_gpu3 (for stage_eagle3_gpu3_eval.sh); into $OUT: the
# head (bf16, ~15.3 MiB) and its JSON, metrics.jsonl, the training curve, the summary, the log.
#   bash experiments/gpu/stage_eagle3_gpu3.sh
#   SMOKE=1 bash experiments/gpu/stage_eagle3_gpu3.sh   # CPU-sized (configs/eagle3_smollm2_gpu3_smoke.yaml)
source experiments/gpu/stage_mtp2_common.sh
if [ "${SMOKE:-0}" = 1 ]; then E3=configs/eagle3_smollm2_gpu3_smoke.yaml; else E3=configs/eagle3_smollm2_gpu3.yaml; fi
read -r E3_OUTDIR E3_EXPORT E3_INIT <<<"$(spec_fields eagle3 "$E3" out_dir export head.init_from)"
{
  echo "[eagle3 gpu3] rev $SPECJAX_GIT_REV, config $E3, $(python3 -c 'import jax; print(jax.devices()[0].device_kind)')"
  restore_data "eagle3 gpu3"
  seed_init "eagle3 gpu3" "$E3_INIT" eagle3_gpu2
  timed_run "eagle3 gpu3" "${E3_TIMEOUT:-545}" python3 -m specjax.cli train eagle3 --config "$E3" --no-resume
  export_trained "eagle3 gpu3" "$E3_EXPORT" "$E3_OUTDIR" eagle3_gpu3 eagle3_gpu3_
  # the new data folders stay on this machine for a later call: $PERSIST/eagle3_gpu3_data.tar
  new=$(ls -d "$E3_OUTDIR"/data_* "$E3_OUTDIR"/heldout_* 2>/dev/null || true)
  [ -n "$new" ] && tar cf "$PERSIST/eagle3_gpu3_data.tar" $new && echo "[eagle3 gpu3] new data: $(du -sh "$PERSIST/eagle3_gpu3_data.tar" | cut -f1)"
  ls -la "$OUT"
} 2>&1 | tee "$OUT/stage_eagle3_gpu3.log"
