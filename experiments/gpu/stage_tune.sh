# spec-tune on SmolLM2 (issue 11): the tuned config must beat the default on held-out prompts. ~9 min.
source experiments/gpu/env.sh
timeout 540 python3 -m specjax.cli tune --config configs/tune_smollm2.yaml --out $OUT --quiet 2>&1 | tail -30
ls -la $OUT
