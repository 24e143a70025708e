#!/usr/bin/env bash
# Serving under load on the GPU machine: `specjax bench-serve` with CONFIG (SmolLM2-135M-Instruct bf16
# behind a 64-slot server, streamed greedy chat requests of 128 tokens with MT-bench first turns, at 1,
# 8, 32 and 64 concurrent clients): plain decoding, then each of METHODS; JSON + PNG into $OUT.
# The server runs up to 8 rounds per device call over the live slots gathered into batch buckets of
# 1, 8, 32 or 64 (the config's serve: section); the clients run in processes of their own (one per 8
# clients), not in the server's process. Every server compiles its programs (every bucket) and gets
# every distinct prompt once (untimed) before its levels are timed; the JSON (git revision, device,
# config, a row per method and level with its device calls and rounds by bucket) and the PNG are
# rewritten after every level, so a run cut by TIMEOUT keeps the levels it finished. Each server's
# warm-up time is printed ([bench-serve] METHOD: ... warm-up compiled in X s): a 64-slot server
# compiles ~25-30 programs, minutes on a GPU the first time; they stay in the compile cache
# ($SPECJAX_HOME/jax_cache) while the machine is held, so a later call's servers skip what is there.
# Environment: METHODS [ngram_simple_tuned,mtp_n3,dflash_tree_32]: method names of CONFIG (it also
# has ngram_simple_tuned_adaptive, mtp_n3_adaptive, eagle3_tree_48, dflash_tree_32_adaptive); CONFIG
# [configs/bench_serve_smollm2.yaml]; NAME [the config's file stem]: output file stem; TIMEOUT [540]
# seconds; RETURN_CACHE [0]: 1 returns the compile cache in pieces (bootstrap.sh's return_jax_cache;
# carried back, the next machine's servers skip those compilations); the rest as in bootstrap.sh (OUT required). Further arguments go to `specjax bench-serve`
# (--concurrency 1,64, --num-prompts N, --prompts-per-client N, --max-tokens N, --client-processes N,
# --no-plain).
# Example:  OUT=/tmp/o bash experiments/gpu/bench_serve.sh
#           OUT=/tmp/o METHODS=ngram_simple_tuned,ngram_simple_tuned_adaptive,mtp_n3,mtp_n3_adaptive \
#             bash experiments/gpu/bench_serve.sh
# A CPU check of the script (tiny counts, not a measurement; SPECJAX_HOME / SPECJAX_DATA where the
# model and MT-bench are cached, since SMOKE=1 installs nothing):
#           SMOKE=1 OUT=/tmp/o SPECJAX_HOME=~/.cache/specjax SPECJAX_DATA=~/.cache/specjax/data \
#             CONFIG=configs/bench_serve_smollm2_cpu_smoke.yaml METHODS=ngram_simple_tuned_adaptive,mtp_n3 \
#             bash experiments/gpu/bench_serve.sh
source "$(dirname "$0")/bootstrap.sh"
CONFIG=${CONFIG:-configs/bench_serve_smollm2.yaml}
METHODS=${METHODS:-ngram_simple_tuned,mtp_n3,dflash_tree_32}
NAME=${NAME:-$(basename "$CONFIG" .yaml)}
echo "[bench-serve] $CONFIG: plain,$METHODS on $(device_kind)"
timed_run bench-serve "${TIMEOUT:-540}" python3 -m specjax.cli bench-serve --config "$CONFIG" --methods "$METHODS" \
  --out "$OUT/$NAME" "$@"
python3 -c "import json, sys; r = json.load(open(sys.argv[1]));
print('rev', r['git_rev'], 'on', r['device']['device_kind']);
[print(f\"{s['method']:30s} c={s.get('concurrency')!s:>3s} {s['throughput_tok_s']:9.1f} tok/s  tau {s['tau'] or 0:.2f}\",
       f\"ttft p50 {1e3 * (s['ttft_s']['p50'] or 0):6.1f} ms  calls {s.get('device_calls')}  prefill calls {s.get('prefill_calls')} ({s.get('prefill_rows')} rows)  compiles {s.get('compiles')}\",
       f\"({s.get('compile_s')} s)  rounds by batch {s.get('rounds_by_batch')}  thread s {s.get('model_thread_s')}\")
 for s in r['rows']]" \
  "$OUT/$NAME.json" || true
if [ "${RETURN_CACHE:-0}" = 1 ]; then return_jax_cache; fi
ls -la "$OUT"
