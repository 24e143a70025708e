#!/usr/bin/env bash
# Issue 8: how tree tau grows with the tree's size for the committed EAGLE-3 head
# (assets/eagle3_smollm2), MT-bench questions 1-16 (first turns), greedy, float32 (tau does not
# depend on the device, so this runs on a CPU; speed is not measured). One JSON per tree shape in
# $OUT (default experiments/results/eagle3_tree_budget_cpu), then a summary JSON + PNG.
#   bash experiments/eagle3_tree_budget.sh            # ~25 min on 2 CPU cores
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-experiments/results/eagle3_tree_budget_cpu}
TREES=${TREES:-"6,8,48 8,8,64 8,10,96"}
mkdir -p "$OUT"
for tree in $TREES; do
  python -m specjax.cli train eval-eagle3 --config configs/eagle3_smollm2.yaml --dtype float32 --quiet \
    --head assets/eagle3_smollm2/eagle3_head.safetensors --n-questions ${N_Q:-16} --batch-size 8 \
    --n-max 5 --tree "$tree" --temperatures 0 --out "$OUT/tree_${tree//,/_}.json"
done
python experiments/eagle3_tree_budget_summary.py "$OUT"/tree_*.json --out "$OUT/summary.json"
