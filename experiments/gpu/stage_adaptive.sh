# Adaptive drafting vs fixed draft lengths at batch 64/32/1 (issue 11), ~9 minutes on an H200.
source experiments/gpu/env.sh
for b in 64 32 1; do
  timeout 200 python3 -m specjax.cli bench --config configs/adaptive_smollm2_b$b.yaml --out $OUT $([ $b = 1 ] && echo "--limit 16") 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|prompt/s" | tail -9
done
python3 experiments/adaptive_summary.py $OUT/adaptive_smollm2_b*.json --out $OUT/adaptive_smollm2_summary.json | tail -5 || true
ls -la $OUT
