# Issue 11: the second tuner run (configs/tune_smollm2_device.yaml: device speculators only, adaptive
# drafting as a searched dimension, the MTP head, 20 held-out questions). ~9.5 min on an H200;
# carry assets/mtp_smollm2_gpu.
source experiments/gpu/env.sh
timeout 560 python3 -m specjax.cli tune --config configs/tune_smollm2_device.yaml --out $OUT --quiet 2>&1 | tail -40
ls -la $OUT
