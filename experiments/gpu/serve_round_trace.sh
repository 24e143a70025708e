#!/usr/bin/env bash
# Why a server round costs more than the engine's on the GPU: experiments/serve_round_cost.py with
# --trace (device busy time, kernels and gaps per round), keeping each row's profiler trace and the
# optimized HLO of the two loop programs (the engine's `device_loop`, the server's `run_rounds`),
# whose thunk / command-buffer structure says which parts of a round the GPU runs as one graph and
# which the host launches kernel by kernel. SmolLM2's shapes with random weights (no weights needed).
# Writes $OUT/serve_round_trace.json, $OUT/serve_round_trace.log and $OUT/traces_and_hlo.tar.gz.
# Parameters: serve_round_cost.py flags replacing the defaults below (e.g. --speculator mtp --n-max 3).
# Environment: TIMEOUT [500] seconds; the rest as in bootstrap.sh (OUT required).
# SMOKE=1: the CPU dry run (a tiny target; a CPU trace has no device events).
# Example:  OUT=/tmp/o bash experiments/gpu/serve_round_trace.sh --speculator mtp --n-max 3
source "$(dirname "$0")/bootstrap.sh"
WORKDIR=$(mktemp -d)
if [ "${SMOKE:-0}" = 1 ]; then SHAPE="--tiny --new-tokens 16 --capacity 128"; else SHAPE="--random-shape --new-tokens 128"; fi
set -o pipefail
XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$WORKDIR/hlo --xla_dump_hlo_module_re=.*(device_loop|run_rounds).* --xla_dump_hlo_as_text" \
  timed_run serve-round-trace "${TIMEOUT:-500}" python3 experiments/serve_round_cost.py $SHAPE --slots 1 \
  --rounds-per-call 1 8 --repeats 2 --trace --trace-top 20 --trace-dir "$WORKDIR/traces" \
  --out "$OUT/serve_round_trace.json" "$@" 2>&1 | grep -v "it/s\]" | tee "$OUT/serve_round_trace.log"
# only the optimized modules and the traces come back (one file: $OUT holds at most 8)
(cd "$WORKDIR" && find hlo -name '*after_optimizations*' -o -name '*thunk*' > keep.txt; find traces -type f >> keep.txt;
 tar czf "$OUT/traces_and_hlo.tar.gz" -T keep.txt)
ls -la "$OUT"
