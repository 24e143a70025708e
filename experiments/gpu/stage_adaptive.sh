# Adaptive drafting vs fixed draft lengths at batch 64/32/1 (issue 11; batch 1 on 32 prompts): ~3.5-4 minutes per batch size
# on an H100 (the kernels' first-use checks included), so two calls: BATCHES="64 32", then BATCHES=1.
# Every bench method compiles for ~20-25 s on an H200, and the adaptive method's warm-up compiles
# and times every width (engine._measure_round_costs), so each batch size needs ~3 minutes.
# Results are packed into one tar after each bench (a call returns at most 8 files), so a call cut
# short still returns what finished.
source experiments/gpu/env.sh
mkdir -p $OUT/r
for b in ${BATCHES:-64 32 1}; do   # BATCHES="64 32" and BATCHES=1 split it over two calls
  timeout $([ $b = 1 ] && echo 420 || echo 270) python3 -m specjax.cli bench --config configs/adaptive_smollm2_b$b.yaml \
    --out $OUT/r $([ $b = 1 ] && echo "--limit 32") 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|prompt/s" | tail -8
  tar -C $OUT -cf $OUT/adaptive_results.tar r
done
python3 experiments/adaptive_summary.py $OUT/r/adaptive_smollm2_b*.json --out $OUT/r/adaptive_smollm2_summary.json | tail -5 || true
tar -C $OUT -cf $OUT/adaptive_results.tar r && rm -rf $OUT/r
ls -la $OUT
