#!/usr/bin/env bash
# spec-tune on the GPU machine: trials, best.yaml and the held-out comparison into $OUT.
# Parameters: CONFIG (a tune config), then any `specjax tune` flags (--seconds, --trials, ...).
# Environment: TIMEOUT [560] seconds; the rest as in bootstrap.sh (OUT required).
# Example:  OUT=/tmp/o bash experiments/gpu/tune.sh configs/tune_device_speculators_smollm2_mt_bench.yaml
source "$(dirname "$0")/bootstrap.sh"
CONFIG=${1:?usage: tune.sh CONFIG [specjax tune flags]}; shift
echo "[tune] $CONFIG on $(device_kind)"
timed_run tune "${TIMEOUT:-560}" python3 -m specjax.cli tune --config "$CONFIG" --out "$OUT" --quiet "$@"
ls -la "$OUT"
