# Issue 8: evaluate the EAGLE-3 head of stage_mtp2_eagle3.sh (from /root/persist/eagle3_gpu2) on
# MT-bench first turns: chains n_max 1..5 and EAGLE-2 trees at batch 1 (the bar is tree tau >= 3.0
# greedy; at batch 8 a 48-node tree cost more than it saved), greedy and T=0.7, next to the MTP head
# (carry assets/mtp_smollm2_gpu2; on a fresh machine also carry assets/eagle3_smollm2_gpu2 and pass HEAD=assets/eagle3_smollm2_gpu2/eagle3_head.safetensors). ~8 min on an H200 with N_Q=24 (compilation included).
#   bash experiments/gpu/stage_mtp2_eagle3_eval.sh
source experiments/gpu/env.sh
HEAD=${HEAD:-/root/persist/eagle3_gpu2/eagle3_head.safetensors}
[ -f "$HEAD" ] || { echo "no $HEAD: run stage_mtp2_eagle3.sh first"; exit 1; }
timeout ${EVAL_TIMEOUT:-500} python3 -m specjax.cli train eval-eagle3 --config configs/eagle3_smollm2_gpu2.yaml \
  --head "$HEAD" --n-questions ${N_Q:-24} --batch-size 1 --tree ${TREE:-6,8,32} --n-max 1,3,5 \
  --mtp-head ${MTP_HEAD:-assets/mtp_smollm2_gpu2/mtp_head.safetensors} --out $OUT/eagle3_gpu2_eval_mt_bench.json 2>&1 \
  | tr '\r' '\n' | grep -v "it/s\|s/it" | tail -30 || echo "evaluation stopped: partial results kept"
ls -la $OUT
