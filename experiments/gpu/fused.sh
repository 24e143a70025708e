#!/usr/bin/env bash
# The fused decode kernels on a 2-GPU machine (nvidia-h200-x2 / h100-x2): their tilings measured, then
# plain decoding with and without them, side by side on one GPU. SmolLM2-135M shapes, random bf16
# weights (nothing to carry but the wheels).
#   GPU 0: experiments/fused_tiling_sweep.py (SWEEP_S seconds of tilings; table -> $WORK/fused_tilings.json),
#          then decode_flags.py --random-shape, variants default and fused_layers (that table) at batch 1 / 8;
#   GPU 1: decode_flags.py variants default and two_row_products, then, once the table exists,
#          bench_fused_layer.py (one layer and a whole step, XLA vs fused, batch 1 / 8, decode and a
#          4-token verification).
# Writes into $OUT: fused_sweep.json, fused_tilings.json, decode_fused.json, decode_xla.json,
# fused_layer.json, fused_layer_verify4.json, gpu0.log, gpu1.log.
# Environment: SWEEP_S [270]; the rest as in bootstrap.sh (OUT required).
# Example:  OUT=/tmp/o bash experiments/gpu/fused.sh
source "$(dirname "$0")/bootstrap.sh"
TABLE=$WORK/fused_tilings.json
rm -f "$TABLE"
export SPECJAX_FUSED_TILINGS=$TABLE
(
  export CUDA_VISIBLE_DEVICES=0
  timed_run sweep $(( ${SWEEP_S:-270} + 90 )) python3 experiments/fused_tiling_sweep.py --budget-s "${SWEEP_S:-270}" \
    --out "$OUT/fused_sweep.json" --table-out "$TABLE.tmp"
  mv "$TABLE.tmp" "$TABLE" && cp "$TABLE" "$OUT/fused_tilings.json"
  timed_run decode_fused 240 python3 experiments/decode_flags.py --random-shape --variants default fused_layers \
    --batch 1 8 --out "$OUT/decode_fused.json"
) > "$OUT/gpu0.log" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  timed_run decode_xla 240 python3 experiments/decode_flags.py --random-shape --variants default two_row_products \
    --batch 1 8 --out "$OUT/decode_xla.json"
  for _ in $(seq 1 120); do [ -f "$TABLE" ] && break; sleep 5; done
  timed_run fused_layer 150 python3 experiments/bench_fused_layer.py --batch 1 8 --out "$OUT/fused_layer.json"
  timed_run fused_layer_verify4 120 python3 experiments/bench_fused_layer.py --batch 1 8 --tokens 4 --skip layer \
    --out "$OUT/fused_layer_verify4.json"
) > "$OUT/gpu1.log" 2>&1 &
wait
cat "$OUT/gpu0.log" "$OUT/gpu1.log"
