# Session B: adaptive drafting vs fixed draft lengths at batch 1/32/64 (issue 11), then the hybrid
# rollback benchmark (issue 6) with the whole state live.
source experiments/gpu/env.sh
for b in 64 32 1; do
  timeout 150 python3 -m specjax.cli bench --config configs/adaptive_smollm2_b$b.yaml --out $OUT $([ $b = 1 ] && echo "--limit 24") 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|prompt/s" | tail -9
done
python3 experiments/adaptive_summary.py $OUT/adaptive_smollm2_b*.json --out $OUT/adaptive_smollm2_summary.json | tail -5 || true
timeout 170 python3 experiments/hybrid_rollback.py --batch 1 16 --k 2 4 8 16 --context 1024 --repeats 10 \
  --out $OUT/hybrid_rollback.json 2>&1 | grep -v Warning
ls -la $OUT
