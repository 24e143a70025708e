# Issue 9: the third DFlash drafter (stage_dflash_gpu3.sh; the second round's, gpu3b, when there is
# one) against plain decoding, the second MTP head (n_max 3) and the third EAGLE-3 head (chain n_max 5
# and an EAGLE-2 tree), all in one process: DFlash as a chain (15 drafts) and as best-first trees over
# its per-position distributions (dflash_tree, node budgets TREE). Batch 1, 128 new tokens, greedy and
# T=0.7; PROMPTS (default all 80 MT-bench first turns and HumanEval 1-16, held out of training). ~8
# minutes on an H100, capped at EVAL_TIMEOUT (540 s); the JSON (+ PNG) is rewritten after each prompt
# set. Drafter and heads are read from /root/persist (dflash_gpu3b or dflash_gpu3, mtp_gpu2,
# eagle3_gpu3: on a fresh machine carry them in .gpucarry/persist/), else from assets/.
#   bash experiments/gpu/stage_dflash_gpu3_eval.sh
#   PROMPTS=mt_bench:24 TREE=32 bash experiments/gpu/stage_dflash_gpu3_eval.sh
#   N_MAX= TREE=64,128 TREE_DEPTH=12 bash experiments/gpu/stage_dflash_gpu3_eval.sh   # trees only (N_MAX empty: no chain)
#   REPEATS=3 ...   # each batch timed 3 times, the fastest counts (runs of one call vary by several percent)
#   SMOKE=1 bash experiments/gpu/stage_dflash_gpu3_eval.sh   # CPU-sized, after SMOKE=1 stage_dflash_gpu3.sh
source experiments/gpu/stage_mtp2_common.sh
if [ "${SMOKE:-0}" = 1 ]; then
  DF=configs/dflash_smollm2_gpu3_smoke.yaml; PROMPTS=${PROMPTS:-"mt_bench:2,humaneval:1"}; SIZE="--max-new-tokens 16 --batch-size 1"
else
  DF=configs/dflash_smollm2_gpu3.yaml; PROMPTS=${PROMPTS:-"mt_bench:80,humaneval:16"}; SIZE="--max-new-tokens 128 --batch-size 1"
fi
first() { for f in "$@"; do [ -f "$f" ] && { echo "$f"; return; }; done; echo "$1"; }
HEAD=${HEAD:-$(first "$PERSIST/dflash_gpu3b/dflash.safetensors" "$PERSIST/dflash_gpu3/dflash.safetensors" \
  assets/dflash_smollm2_gpu3/dflash.safetensors)}
MTP=${MTP_HEAD:-$(first "$PERSIST/mtp_gpu2/mtp_head.safetensors" assets/mtp_smollm2_gpu2/mtp_head.safetensors)}
E3=${EAGLE3_HEAD:-$(first "$PERSIST/eagle3_gpu3/eagle3_head.safetensors" assets/eagle3_smollm2_gpu3/eagle3_head.safetensors)}
TAG=${TAG:-dflash_gpu3_eval}
{
  echo "[$TAG] rev $SPECJAX_GIT_REV, drafter $HEAD, $(python3 -c 'import jax; print(jax.devices()[0].device_kind)')"
  [ -f "$HEAD" ] || { echo "[$TAG] no $HEAD: run stage_dflash_gpu3.sh first"; exit 1; }
  [ -f "$MTP" ] || echo "[$TAG] no MTP head $MTP: left out"
  [ -f "$E3" ] || echo "[$TAG] no EAGLE-3 head $E3: left out"
  timed_run "$TAG" "${EVAL_TIMEOUT:-540}" python3 -m specjax.cli train eval-dflash --config "$DF" \
    --head "$HEAD" --prompts "$PROMPTS" --temperatures "${TEMPS:-0,0.7}" --n-max "${N_MAX-15}" \
    --tree "${TREE:-32,64}" --tree-depth "${TREE_DEPTH:-8}" --tree-top-k "${TREE_TOP_K:-8}" $SIZE \
    --repeats "${REPEATS:-1}" \
    $([ -f "$MTP" ] && echo "--mtp-head $MTP") \
    $([ -f "$E3" ] && echo "--eagle3-head $E3 --eagle3-tree ${E3_TREE:-32}") \
    --out "$OUT/$TAG.json"
  ls -la "$OUT"
} 2>&1 | tee "$OUT/stage_$TAG.log"
