#!/usr/bin/env bash
# Two revisions' speed side by side in one GPU call: each bench CONFIG runs with the code in $OLD (a
# folder holding another revision's specjax/, made with `git archive REV specjax | tar -x -C DIR`)
# and with this checkout, in fresh processes on the same machine; both result JSONs and a
# comparison (tokens/s, tau, equality per method; new / old) go to $OUT.
# Environment: OLD (required), OLD_REV (its label in the result), TIMEOUT [280] seconds per run,
# METHODS (comma-separated method names of the config to keep; default all), ORDER ["old new"]
# (run "new old" too, to see whether the order matters); the rest as in bootstrap.sh (OUT required).
# Example:  git archive d596a68 specjax | tar -x -C .gpucarry/old
#           OUT=/tmp/o OLD=.gpucarry/old OLD_REV=d596a68 bash experiments/gpu/engine_regression.sh \
#             configs/bench_engine_regression_smollm2_b1.yaml
source "$(dirname "$0")/bootstrap.sh"
: "${OLD:?set OLD to a folder holding the code of the other revision (its specjax folder)}"
OLD=$(cd "$OLD" && pwd)
for cfg in "$@"; do
  stem=$(basename "$cfg" .yaml)${METHODS:+_$(echo "$METHODS" | tr ',' '_')}
  if [ -n "$METHODS" ]; then        # a copy of the config with only those methods
    python3 -c "import sys, yaml; c = yaml.safe_load(open(sys.argv[1])); keep = sys.argv[2].split(',');
c['methods'] = [m for m in c['methods'] if m['name'] in keep]; yaml.safe_dump(c, open(sys.argv[3], 'w'))" \
      "$cfg" "$METHODS" "/tmp/$stem.yaml"
    cfg=/tmp/$stem.yaml
  fi
  for which in ${ORDER:-old new}; do
    echo "[regression] $cfg on $(device_kind): $which"
    if [ "$which" = old ]; then   # the old code first on sys.path (python -m would put this checkout's first)
      timed_run old "${TIMEOUT:-280}" env SPECJAX_GIT_REV="${OLD_REV:-old}" python3 -c \
        "import sys, runpy; sys.path.insert(0, '$OLD'); runpy.run_module('specjax.cli', run_name='__main__', alter_sys=True)" \
        bench --config "$cfg" --out "$OUT" --name "${stem}_old"
    else
      timed_run new "${TIMEOUT:-280}" python3 -m specjax.cli bench --config "$cfg" --out "$OUT" --name "${stem}_new"
    fi
  done
  python3 experiments/compare_revisions.py "$OUT/${stem}_old.json" "$OUT/${stem}_new.json" \
    --out "$OUT/${stem}_compare.json" || true
done
