# Session A, call 3: hybrid rollback (issue 6) and the model-free MT-bench rerun with the fixed
# harness (issue 5). ~8 minutes on an H200.
source experiments/gpu/env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 experiments/hybrid_rollback.py --batch 1 16 --k 2 4 8 16 --context 1024 --repeats 10 \
  --out $OUT/hybrid_rollback.json 2>&1 | grep -v Warning
timeout 330 python3 -m specjax.cli bench --config configs/modelfree_smollm2_mt_bench.yaml --limit 20 --out $OUT || echo "bench timed out"
ls -la $OUT
