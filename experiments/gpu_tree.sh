#!/usr/bin/env bash
# Tree verification cost (issue 8, item 4): one tree verification round (T = 8, 16, 32, 64 nodes, random
# trees; greedy, and with proper q at temperature 0.7 for T = 16, 64) vs a chain round verifying the same
# number of tokens, batch 1 and 8, SmolLM2-135M-Instruct real weights in bf16, 512-token context.
# Writes $OUT/tree_round.json (config, git revision, device, ms per round). ~1-2 min with compilation.
#
#   OUT=/tmp/out bash experiments/gpu_tree.sh              # on the GPU machine
#   SMOKE=1 OUT=/tmp/tree_smoke bash experiments/gpu_tree.sh   # tiny CPU check (float32, T=8, batch 1)
#
# Expects (the GPU machine sets them): PYTHONPATH with jax/flax/etc., SPECJAX_HOME holding
# smollm2-135m-instruct, SPECJAX_GIT_REV.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder whose files come back}"
export PYTHONUNBUFFERED=1
export SPECJAX_GIT_REV=${SPECJAX_GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

if [ "${SMOKE:-0}" = 1 ]; then
  ARGS="--dtype float32 --nodes 8 --q-nodes 8 --batch 1 --context 32 --rounds 2 --repeats 1"
else
  ARGS="--dtype bfloat16 --nodes 8 16 32 64 --q-nodes 16 64 --batch 1 8 --context 512 --rounds 20 --repeats 5 --budget-s 150"
fi
python3 experiments/bench_tree_round.py $ARGS --out "$OUT/tree_round.json"
ls -la "$OUT"
