# Issue 9, third and fourth DFlash drafters (configs/dflash_smollm2_gpu3.yaml, DF=configs/dflash_smollm2_gpu4.yaml): restores the data folders of
# stage_mtp2_data.sh from /root/persist/mtp2_data.tar (seed it from .gpucarry/persist/ on a fresh
# machine), warm-starts from the second drafter (assets/dflash_smollm2_gpu2, carried, or
# /root/persist/dflash_gpu2) with one more layer, builds the held-out Magpie folder and new Magpie
# folders while data_budget_s (160 s) allows, trains for what is left of wall_budget_s (500 s), exports
# and scores the drafter on held-out and training rows. One call, capped at DF_TIMEOUT (550 s; ~9.5
# minutes with the setup). The drafter goes to /root/persist/dflash_gpu3 (for stage_dflash_gpu3_eval.sh);
# into $OUT: the drafter (bf16, ~19 MB, in 15 MB parts: `cat dflash.safetensors.part* >
# dflash.safetensors`) and its JSON, metrics.jsonl, the training curve, the summary, the log. The new
# data folders stay on the machine in /root/persist/dflash_gpu3_data.tar.
#   bash experiments/gpu/stage_dflash_gpu3.sh
#   DF=configs/dflash_smollm2_gpu3b.yaml bash experiments/gpu/stage_dflash_gpu3.sh   # a second round, same machine
#   SMOKE=1 bash experiments/gpu/stage_dflash_gpu3.sh   # CPU-sized (configs/dflash_smollm2_gpu3_smoke.yaml),
#                                                      # after SMOKE=1 bash experiments/gpu/stage_mtp2_data.sh
source experiments/gpu/stage_mtp2_common.sh
if [ "${SMOKE:-0}" = 1 ]; then DF=${DF:-configs/dflash_smollm2_gpu3_smoke.yaml}; else DF=${DF:-configs/dflash_smollm2_gpu3.yaml}; fi
read -r DF_NAME DF_OUTDIR DF_EXPORT DF_INIT <<<"$(spec_fields dflash "$DF" name out_dir export drafter.init_from)"
TAG=dflash_${DF_NAME#dflash_smollm2_}   # dflash_gpu3, dflash_gpu3b: the /root/persist folder and the $OUT prefix
{
  echo "[dflash gpu3] rev $SPECJAX_GIT_REV, config $DF, $(python3 -c 'import jax; print(jax.devices()[0].device_kind)')"
  restore_data "dflash gpu3"
  # a warm start from out/NAME/export/ comes from /root/persist/NAME when this machine did not train it
  init_name=$(echo "$DF_INIT" | sed -n 's#^out/\([^/]*\)/export/.*#\1#p')
  seed_init "dflash gpu3" "$DF_INIT" "${init_name:-dflash_gpu2}"
  timed_run "dflash gpu3" "${DF_TIMEOUT:-550}" python3 -m specjax.cli train dflash --config "$DF" --no-resume
  export_trained "$TAG" "$DF_EXPORT" "$DF_OUTDIR" "$TAG" "${TAG}_"
  # $OUT takes files up to 16 MiB: the drafter comes back in parts
  for f in "$OUT"/*.safetensors; do
    [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt 15728640 ] && split -b 15M -d "$f" "$f.part" && rm "$f"
  done
  new=$(ls -d "$DF_OUTDIR"/data_* "$DF_OUTDIR"/heldout_* 2>/dev/null || true)
  [ -n "$new" ] && tar cf "$PERSIST/${TAG}_data.tar" $new && echo "[dflash gpu3] new data: $(du -sh "$PERSIST/${TAG}_data.tar" | cut -f1)"
  ls -la "$OUT"
} 2>&1 | tee "$OUT/stage_$TAG.log"
