#!/usr/bin/env bash
# One `specjax bench` config on the GPU machine: JSON + PNG into $OUT, under a time limit.
# Parameters: CONFIG, then any `specjax bench` flags (--limit N, --resume, ...).
# Environment: TIMEOUT [540] seconds; JAX_DEFAULT_MATMUL_PRECISION etc. pass through; the rest as
# in bootstrap.sh (OUT required). RETURN_CACHE=1: the compile cache comes back in $OUT in pieces
# (bootstrap.sh's return_jax_cache; carry them in .gpucarry/jax_cache/ to seed the next machine). A run cut by the limit keeps the rows it finished (--resume).
# Example:  OUT=/tmp/o bash experiments/gpu/bench.sh configs/bench_mtp_smollm2_mt_bench_greedy.yaml
#           for b in 64 32; do OUT=/tmp/o bash experiments/gpu/bench.sh configs/bench_adaptive_smollm2_b$b.yaml; done
# KEEP=1: the run's folder stays on the machine ($WORK/runs/CONFIG-NAME) and runs with --resume, so a
# later call on the same machine continues a run the limit cut; its files are copied into $OUT.
source "$(dirname "$0")/bootstrap.sh"
CONFIG=${1:?usage: bench.sh CONFIG [specjax bench flags]}; shift
echo "[bench] $CONFIG on $(device_kind)"
dest=$OUT
if [ "${KEEP:-0}" = 1 ]; then dest=$WORK/runs/$(basename "$CONFIG" .yaml); mkdir -p "$dest"; set -- --resume "$@"; fi
timed_run bench "${TIMEOUT:-540}" python3 -m specjax.cli bench --config "$CONFIG" --out "$dest" "$@" || true
if [ "$dest" != "$OUT" ]; then cp -r "$dest"/. "$OUT"/; fi
if [ "${RETURN_CACHE:-0}" = 1 ]; then return_jax_cache; fi
ls -la "$OUT"
