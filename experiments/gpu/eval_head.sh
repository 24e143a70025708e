#!/usr/bin/env bash
# A trained EAGLE-3 head or DFlash drafter against plain decoding in one process, with the other
# committed heads beside it: tau, acceptance by position / depth, tok/s, speedup, equality.
# (An MTP head is evaluated by a bench config: bench.sh configs/bench_mtp_smollm2_mt_bench_greedy.yaml.)
# Parameters: KIND (eagle3 | dflash), CONFIG (its training spec), HEAD (default: the committed one).
#   eagle3: `specjax train eval-eagle3`, N_Q [24] MT-bench first turns (those the spec evaluates on), chains
#           N_MAX [1,3,5] and an EAGLE-2 tree TREE [6,8,32] (depth,top-k,nodes), batch 1.
#   dflash: `specjax train eval-dflash` on PROMPTS [mt_bench:80,humaneval:16] (HumanEval 1-16 are
#           held out of DFlash training), chain N_MAX [15] (empty: no chain) and dflash_tree node
#           budgets TREE [32,64] at depth TREE_DEPTH [8], top-k TREE_TOP_K [8], EAGLE-3 tree E3_TREE [32].
# Environment: BATCH [1] (dflash: batch size), TEMPS [0,0.7], REPEATS [1] (each batch timed N times, the fastest counts), MTP_HEAD /
# EAGLE3_HEAD [the committed heads; /none leaves one out], TAG [eval_KIND], TIMEOUT [540];
# SMOKE=1: CPU-sized (2 prompts, 16 tokens, small trees); the rest as in bootstrap.sh (OUT required).
# Example:  OUT=/tmp/o bash experiments/gpu/eval_head.sh dflash configs/train_dflash_smollm2_gpu_step5.yaml
#           OUT=/tmp/o PROMPTS=mt_bench:80 TEMPS=0 N_MAX= TREE=64,128 TREE_DEPTH=12 bash experiments/gpu/eval_head.sh dflash configs/train_dflash_smollm2_gpu_step5.yaml
source "$(dirname "$0")/bootstrap.sh"
KIND=${1:?usage: eval_head.sh eagle3|dflash CONFIG [HEAD]}; CONFIG=${2:?usage: eval_head.sh KIND CONFIG [HEAD]}
case $KIND in
  eagle3) HEAD=${3:-assets/smollm2/eagle3/eagle3_head.safetensors} ;;
  dflash) HEAD=${3:-assets/smollm2/dflash/dflash.safetensors} ;;
  *) echo "usage: eval_head.sh eagle3|dflash CONFIG [HEAD]"; exit 2 ;;
esac
MTP=${MTP_HEAD:-assets/smollm2/mtp/mtp_head.safetensors}; E3=${EAGLE3_HEAD:-assets/smollm2/eagle3/eagle3_head.safetensors}
TAG=${TAG:-eval_$KIND}
{
  echo "[$TAG] $HEAD, rev $SPECJAX_GIT_REV, $(device_kind)"
  [ -f "$HEAD" ] || { echo "[$TAG] no $HEAD"; exit 1; }
  [ -f "$MTP" ] || echo "[$TAG] no MTP head $MTP: left out"
  if [ "$KIND" = eagle3 ]; then
    if [ "${SMOKE:-0}" = 1 ]; then SIZE="--n-questions 2 --max-new-tokens 16 --tree 3,4,8 --n-max 1,3 --dtype float32"
    else SIZE="--n-questions ${N_Q:-24} --tree ${TREE:-6,8,32} --n-max ${N_MAX:-1,3,5}"; fi
    timed_run "$TAG" "${TIMEOUT:-540}" python3 -m specjax.cli train eval-eagle3 --config "$CONFIG" --head "$HEAD" \
      --batch-size 1 $SIZE --temperatures "${TEMPS:-0,0.7}" \
      $([ -f "$MTP" ] && echo "--mtp-head $MTP") --out "$OUT/$TAG.json"
  else
    if [ "${SMOKE:-0}" = 1 ]; then PROMPTS=${PROMPTS:-mt_bench:2,humaneval:1}; SIZE="--max-new-tokens 16 --batch-size 1"
    else PROMPTS=${PROMPTS:-mt_bench:80,humaneval:16}; SIZE="--max-new-tokens 128 --batch-size ${BATCH:-1}"; fi
    [ -f "$E3" ] || echo "[$TAG] no EAGLE-3 head $E3: left out"
    timed_run "$TAG" "${TIMEOUT:-540}" python3 -m specjax.cli train eval-dflash --config "$CONFIG" \
      --head "$HEAD" --prompts "$PROMPTS" --temperatures "${TEMPS:-0,0.7}" --n-max "${N_MAX-15}" \
      --tree "${TREE:-32,64}" --tree-depth "${TREE_DEPTH:-8}" --tree-top-k "${TREE_TOP_K:-8}" $SIZE \
      --repeats "${REPEATS:-1}" $([ -f "$MTP" ] && echo "--mtp-head $MTP") \
      $([ -f "$E3" ] && echo "--eagle3-head $E3 --eagle3-tree ${E3_TREE:-32}") --out "$OUT/$TAG.json"
  fi
  ls -la "$OUT"
} 2>&1 | tee "$OUT/$TAG.log"
