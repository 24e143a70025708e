# Issue 8: evaluate the third EAGLE-3 head (stage_eagle3_gpu3.sh, from /root/persist/eagle3_gpu3) on
# MT-bench q81-104 first turns at batch 1, as stage_mtp2_eagle3_eval.sh did the second: chains
# n_max 1/3/5 and the EAGLE-2 tree (depth 6, top-k 8, 32 nodes), greedy and T=0.7, each against plain
# decoding in the same process and next to the second MTP head (carry assets/mtp_smollm2_gpu2; on a
# fresh machine carry the head too and pass HEAD=...). ~8 minutes on an H200, capped at EVAL_TIMEOUT
# (500 s); partial results are kept.
#   bash experiments/gpu/stage_eagle3_gpu3_eval.sh
#   SMOKE=1 bash experiments/gpu/stage_eagle3_gpu3_eval.sh   # CPU-sized: 2 questions, 16 tokens, small tree
if [ "${SMOKE:-0}" = 1 ]; then
  set -e
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
  export SPECJAX_GIT_REV=${SPECJAX_GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  OUT=${OUT:-/tmp/eagle3_gpu3_smoke_out}
  E3=configs/eagle3_smollm2_gpu3_smoke.yaml
  HEAD=${HEAD:-out/eagle3_gpu3_smoke/export/eagle3_head.safetensors}
  ARGS="--n-questions 2 --max-new-tokens 16 --tree 3,4,8 --n-max 1,3 --dtype float32"
else
  source experiments/gpu/env.sh
  E3=configs/eagle3_smollm2_gpu3.yaml
  HEAD=${HEAD:-/root/persist/eagle3_gpu3/eagle3_head.safetensors}
  ARGS="--n-questions ${N_Q:-24} --tree ${TREE:-6,8,32} --n-max 1,3,5"
fi
: "${OUT:?set OUT to the folder whose files come back}"
mkdir -p "$OUT"
[ -f "$HEAD" ] || { echo "no $HEAD: run stage_eagle3_gpu3.sh first"; exit 1; }
MTP=${MTP_HEAD:-assets/mtp_smollm2_gpu2/mtp_head.safetensors}
[ -f "$MTP" ] && MTP_ARG="--mtp-head $MTP" || { echo "no MTP head at $MTP: evaluating without it"; MTP_ARG=""; }
{
  echo "[eagle3 gpu3 eval] rev $SPECJAX_GIT_REV, head $HEAD, $(python3 -c 'import jax; print(jax.devices()[0].device_kind)')"
  timeout ${EVAL_TIMEOUT:-500} python3 -m specjax.cli train eval-eagle3 --config $E3 --head "$HEAD" --batch-size 1 \
    $ARGS $MTP_ARG --out $OUT/eagle3_gpu3_eval_mt_bench.json 2>&1 \
    | tr '\r' '\n' | grep -v "it/s\|s/it" | tail -30 || echo "evaluation stopped: partial results kept"
  ls -la $OUT
} 2>&1 | tee "$OUT/stage_eagle3_gpu3_eval.log"
