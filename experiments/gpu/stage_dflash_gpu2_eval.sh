# Issue 9: evaluate the drafter of stage_dflash_gpu2.sh (from /root/persist/dflash_gpu2) on MT-bench
# q81-104 (first turns) and HumanEval 1-16 (held out of its training), 128 new tokens, batch 8,
# greedy and T=0.7: tau, acceptance by position, tokens/s against plain decoding, the second MTP head
# (n_max 3) and the EAGLE-3 head (chain, n_max 5), all in one process. ~6 minutes on an H100/H200,
# capped at EVAL_TIMEOUT (480 s); the JSON (+ PNG) is rewritten after each prompt set. The heads are
# read from assets/ (carry assets/mtp_smollm2_gpu2 and assets/eagle3_smollm2_gpu2, or pass MTP_HEAD /
# EAGLE3_HEAD; a head that is absent is left out). On a fresh machine carry the drafter in
# .gpucarry/persist/dflash_gpu2/ (seeds /root/persist).
#   bash experiments/gpu/stage_dflash_gpu2_eval.sh          # N_MAX=15,7 also runs a 7-token block
#   SMOKE=1 bash experiments/gpu/stage_dflash_gpu2_eval.sh  # CPU-sized, after SMOKE=1 stage_dflash_gpu2.sh
source experiments/gpu/stage_mtp2_common.sh
if [ "${SMOKE:-0}" = 1 ]; then
  DF=configs/dflash_smollm2_gpu2_smoke.yaml; PROMPTS="mt_bench:2,humaneval:2"; SIZE="--max-new-tokens 16 --batch-size 2"
else
  DF=configs/dflash_smollm2_gpu2.yaml; PROMPTS="mt_bench:24,humaneval:16"; SIZE="--max-new-tokens 128 --batch-size 8"
fi
HEAD=${HEAD:-$PERSIST/dflash_gpu2/dflash.safetensors}
MTP=${MTP_HEAD:-assets/mtp_smollm2_gpu2/mtp_head.safetensors}
E3=${EAGLE3_HEAD:-assets/eagle3_smollm2_gpu2/eagle3_head.safetensors}
{
  echo "[dflash gpu2 eval] rev $SPECJAX_GIT_REV, drafter $HEAD, $(python3 -c 'import jax; print(jax.devices()[0].device_kind)')"
  [ -f "$HEAD" ] || { echo "[dflash gpu2 eval] no $HEAD: run stage_dflash_gpu2.sh first"; exit 1; }
  [ -f "$MTP" ] || echo "[dflash gpu2 eval] no MTP head $MTP: left out"
  [ -f "$E3" ] || echo "[dflash gpu2 eval] no EAGLE-3 head $E3: left out"
  timed_run "dflash gpu2 eval" "${EVAL_TIMEOUT:-480}" python3 -m specjax.cli train eval-dflash --config "$DF" \
    --head "$HEAD" --prompts "$PROMPTS" --temperatures 0,0.7 --n-max "${N_MAX:-15}" $SIZE \
    $([ -f "$MTP" ] && echo "--mtp-head $MTP") $([ -f "$E3" ] && echo "--eagle3-head $E3") \
    --out "$OUT/dflash_gpu2_eval.json" --quiet
  ls -la "$OUT"
} 2>&1 | tee "$OUT/stage_dflash_gpu2_eval.log"
