# Session A, call 4: the MTP head (issue 7): self-distillation data and training on the GPU.
source experiments/gpu/env.sh
python3 -m specjax.cli train data --config configs/mtp_smollm2_gpu.yaml --quiet
timeout 420 python3 -m specjax.cli train mtp --config configs/mtp_smollm2_gpu.yaml --quiet || echo "training stopped (resumable)"
mkdir -p /root/persist/mtp && cp out/mtp_gpu/export/mtp_head.* /root/persist/mtp/ 2>/dev/null || true
cp out/mtp_gpu/export/mtp_head.* out/mtp_gpu/metrics.jsonl out/mtp_gpu/training_curve.png out/mtp_gpu/summary.json $OUT/ 2>/dev/null || true
ls -la $OUT
