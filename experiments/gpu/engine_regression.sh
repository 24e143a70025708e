#!/usr/bin/env bash
# Two revisions' speed side by side in one GPU call: each bench CONFIG runs first with the code in
# $OLD (a folder holding another revision's specjax/, made with `git archive REV specjax | tar -x -C DIR`),
# then with this checkout, in fresh processes on the same machine; both result JSONs and a
# comparison (tokens/s, tau, equality per method; new / old) go to $OUT.
# Environment: OLD (required), OLD_REV (its label in the result), TIMEOUT [280] seconds per run;
# the rest as in bootstrap.sh (OUT required).
# Example:  git archive d596a68 specjax | tar -x -C .gpucarry/old
#           OUT=/tmp/o OLD=.gpucarry/old OLD_REV=d596a68 bash experiments/gpu/engine_regression.sh \
#             configs/bench_engine_regression_smollm2_b1.yaml
source "$(dirname "$0")/bootstrap.sh"
: "${OLD:?set OLD to a folder holding the other revision's specjax/}"
OLD=$(cd "$OLD" && pwd)
for cfg in "$@"; do
  stem=$(basename "$cfg" .yaml)
  echo "[regression] $cfg on $(device_kind): old ($OLD_REV) then new ($SPECJAX_GIT_REV)"
  # the old code first on sys.path (python -m would put this checkout's specjax/ first)
  timed_run old "${TIMEOUT:-280}" env SPECJAX_GIT_REV="${OLD_REV:-old}" python3 -c \
    "import sys, runpy; sys.path.insert(0, '$OLD'); runpy.run_module('specjax.cli', run_name='__main__', alter_sys=True)" \
    bench --config "$cfg" --out "$OUT" --name "${stem}_old"
  timed_run new "${TIMEOUT:-280}" python3 -m specjax.cli bench --config "$cfg" --out "$OUT" --name "${stem}_new"
  python3 experiments/compare_revisions.py "$OUT/${stem}_old.json" "$OUT/${stem}_new.json" \
    --out "$OUT/${stem}_compare.json" || true
done
