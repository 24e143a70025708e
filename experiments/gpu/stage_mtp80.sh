# Issue 7: the session-2 MTP head (assets/mtp_smollm2_gpu, carry it) on all 80 MT-bench first turns,
# greedy, batch 8, n_max 1..4 (configs/mtp_smollm2_mt_bench80_greedy.yaml). ~6-7 minutes on an H200:
# prompts fall into a few 128-token width buckets and every (method, bucket) compiles once (~20 s),
# so most of the time is compilation. A 140 s limit (session 3) got through 16 of 400 prompt runs.
source experiments/gpu/env.sh
timeout 420 python3 -m specjax.cli bench --config configs/mtp_smollm2_mt_bench80_greedy.yaml --out $OUT 2>&1 \
  | tr '\r' '\n' | grep -v "it/s\]$\|prompt/s" | tail -10
ls -la $OUT
