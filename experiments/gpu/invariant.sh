#!/usr/bin/env bash
# Bitwise losslessness in bf16 with the batch-invariant forward, and its cost, on the GPU machine:
# experiments/invariant_equality.py for SmolLM2 (the weights bootstrap.sh installs), plain vs every
# built-in speculator and a chain (heads in assets/smollm2/; --methods picks), default and invariant
# mode, N MT-bench first turns. Writes $OUT/invariant_equality.json (rewritten after every prompt)
# and $OUT/invariant_equality.log.
# Parameters: any invariant_equality.py flags (--limit N, --new-tokens N, --methods ..., --modes ...).
# Environment: TIMEOUT [540] seconds for the whole run; the script stops starting prompts 60 s
# before it (a prompt's runs are saved one by one, so a cut run keeps what it finished).
# RESUME_FROM=FILE: continue the result file an earlier call returned (carry it, e.g. as
# .gpucarry/invariant_equality.json). Compiled programs are kept under $SPECJAX_HOME/jax_cache, so a
# rerun on a machine still warm starts faster; RETURN_CACHE=1 returns that cache in $OUT in pieces
# (bootstrap.sh's return_jax_cache: carry them in .gpucarry/jax_cache/ to seed the next machine).
# The rest as in bootstrap.sh (OUT required).
# Example:  OUT=/tmp/o bash experiments/gpu/invariant.sh --limit 20
#           OUT=/tmp/o RESUME_FROM=.gpucarry/invariant_equality.json bash experiments/gpu/invariant.sh --limit 20
source "$(dirname "$0")/bootstrap.sh"
LIMIT=${TIMEOUT:-540}
RESULT=$OUT/invariant_equality.json
RESUME=
if [ -n "${RESUME_FROM:-}" ] && [ -f "$RESUME_FROM" ]; then cp "$RESUME_FROM" "$RESULT"; RESUME=1; fi
echo "[invariant] on $(device_kind), limit ${LIMIT} s"
set -o pipefail
timed_run invariant "$LIMIT" python3 experiments/invariant_equality.py --out "$RESULT" \
  --budget $((LIMIT > 120 ? LIMIT - 60 : LIMIT / 2)) ${RESUME:+--resume} "$@" | tee "$OUT/invariant_equality.log"
if [ "${RETURN_CACHE:-0}" = 1 ]; then return_jax_cache; fi
ls -la "$OUT"
