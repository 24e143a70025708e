# Session 3, one ~9.5-minute H200 call: the session-2 MTP head on all 80 MT-bench first turns
# (issue 7) and adaptive drafting vs fixed n_max at batch 64 / 32 / 1 after the warm-up fix (issue 11).
# Results come back as one tar (the call returns at most 8 files). Needs assets/mtp_smollm2_gpu carried.
source experiments/gpu/env.sh
bench() {   # each result is packed at once, so a call cut short still returns what finished
  timeout "$1" python3 -m specjax.cli bench --config "$2" --out $OUT/r "${@:3}" 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|prompt/s" | tail -8
  tar -C $OUT -cf $OUT/s3_results.tar r
}
mkdir -p $OUT/r
bench 140 configs/mtp_smollm2_mt_bench80_greedy.yaml
bench 130 configs/adaptive_smollm2_b64.yaml
bench 130 configs/adaptive_smollm2_b32.yaml
bench 100 configs/adaptive_smollm2_b1.yaml --limit 8
python3 experiments/adaptive_summary.py $OUT/r/adaptive_smollm2_b*.json --out $OUT/r/adaptive_smollm2_summary.json | tail -4 || true
tar -C $OUT -cf $OUT/s3_results.tar r && rm -rf $OUT/r
ls -la $OUT
