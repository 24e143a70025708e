# Sourced by experiments/gpu_kernels*.sh: run from the repo root with the GPU machine's caches and
# the carried prompt sets when they are there; $OUT must be set (its files come back).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${OUT:?set OUT to the folder whose files come back}"
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:-/tmp/site:$PWD}"
if [ -z "${SPECJAX_HOME:-}" ] && [ -d /root/h ]; then export SPECJAX_HOME=/root/h; fi       # the GPU machine's model cache
if [ -z "${SPECJAX_DATA:-}" ] && [ -d "$PWD/.data" ]; then export SPECJAX_DATA="$PWD/.data"; fi
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"
