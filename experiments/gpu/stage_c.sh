# Session A, call 5: evaluate the GPU-trained MTP head on MT-bench (greedy and temperature 0.7),
# the float32 equality check, the model-free HumanEval rerun. ~9 minutes on an H200.
source experiments/gpu/env.sh
mkdir -p assets/mtp_smollm2_gpu && cp /root/persist/mtp/mtp_head.* assets/mtp_smollm2_gpu/   # this session's head (stage_b.sh)
python3 -m specjax.cli bench --config configs/mtp_smollm2_mt_bench_greedy.yaml --out $OUT
python3 -m specjax.cli bench --config configs/mtp_smollm2_mt_bench_t07.yaml --out $OUT
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 python3 -m specjax.cli bench --config configs/equality_f32_smollm2.yaml --out $OUT || echo "f32 run timed out"
timeout 200 python3 -m specjax.cli bench --config configs/modelfree_smollm2_humaneval.yaml --limit 16 --out $OUT || echo "humaneval timed out"
ls -la $OUT
