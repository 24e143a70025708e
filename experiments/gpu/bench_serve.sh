#!/usr/bin/env bash
# Serving under load on the GPU machine: `specjax bench-serve` with CONFIG (SmolLM2-135M-Instruct bf16
# behind a 64-slot server, streamed greedy chat requests of 128 tokens with MT-bench first turns, at 1,
# 8, 32 and 64 concurrent clients): plain decoding, then each of METHODS; JSON + PNG into $OUT.
# Every server compiles its programs and gets every distinct prompt once (untimed) before its levels
# are timed; the JSON (git revision, device, config, a row per method and level) and the PNG are
# rewritten after every level, so a run cut by TIMEOUT keeps the levels it finished.
# Environment: METHODS [ngram_simple_tuned,mtp_n3,dflash_tree_32]: method names of CONFIG (it also
# has ngram_simple_tuned_adaptive, mtp_n3_adaptive, eagle3_tree_48); CONFIG
# [configs/bench_serve_smollm2.yaml]; NAME [the config's file stem]: output file stem; TIMEOUT [480]
# seconds; the rest as in bootstrap.sh (OUT required). Further arguments go to `specjax bench-serve`
# (--concurrency 1,64, --num-prompts N, --prompts-per-client N, --max-tokens N, --no-plain).
# Example:  OUT=/tmp/o bash experiments/gpu/bench_serve.sh
#           OUT=/tmp/o METHODS=ngram_simple_tuned,ngram_simple_tuned_adaptive,mtp_n3,mtp_n3_adaptive \
#             bash experiments/gpu/bench_serve.sh
# A CPU check of the script (tiny counts, not a measurement):
#           SMOKE=1 OUT=/tmp/o CONFIG=configs/bench_serve_smollm2_cpu_smoke.yaml \
#             METHODS=ngram_simple_tuned_adaptive,mtp_n3 bash experiments/gpu/bench_serve.sh
source "$(dirname "$0")/bootstrap.sh"
CONFIG=${CONFIG:-configs/bench_serve_smollm2.yaml}
METHODS=${METHODS:-ngram_simple_tuned,mtp_n3,dflash_tree_32}
NAME=${NAME:-$(basename "$CONFIG" .yaml)}
echo "[bench-serve] $CONFIG: plain,$METHODS on $(device_kind)"
timed_run bench-serve "${TIMEOUT:-480}" python3 -m specjax.cli bench-serve --config "$CONFIG" --methods "$METHODS" \
  --out "$OUT/$NAME" "$@"
python3 -c "import json, sys; r = json.load(open(sys.argv[1]));
print('rev', r['git_rev'], 'on', r['device']['device_kind']);
[print(f\"{s['method']:30s} c={s['concurrency']!s:>3s} {s['throughput_tok_s']:9.1f} tok/s  tau {s['tau'] or 0:.2f}\") for s in r['summary']]" \
  "$OUT/$NAME.json" || true
ls -la "$OUT"
