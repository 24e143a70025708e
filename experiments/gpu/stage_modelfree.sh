# Model-free reruns with the fixed harness (issue 5's suffix / ngram_mod / chain numbers are inflated
# in the committed JSONs): MT-bench 12 questions x 2 turns, HumanEval 12 prompts. ~9 minutes on an H200.
source experiments/gpu/env.sh
timeout 300 python3 -m specjax.cli bench --config configs/modelfree_smollm2_mt_bench.yaml --limit 12 --out $OUT 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|prompt/s" | tail -12
timeout 230 python3 -m specjax.cli bench --config configs/modelfree_smollm2_humaneval.yaml --limit 12 --out $OUT 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|prompt/s" | tail -12
ls -la $OUT
