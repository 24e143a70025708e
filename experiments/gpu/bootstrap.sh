#!/usr/bin/env bash
# The GPU machine's setup, shared by every script in experiments/gpu/ (sourced), or run alone
# before a command:  bash experiments/gpu/bootstrap.sh CMD ARGS...
# The lent GPU machine has no network, so what a run needs travels with the checkout:
#   - wheels ($WHEELS/*.whl) are installed once into $SITE (no index, no dependencies);
#   - prompt / data files ($DATA_CARRY/*.jsonl, and *.jsonl.gz unpacked) are copied into $SPECJAX_DATA;
#   - weight chunks ($CHUNKS, made here with `split -b 47M -d MODEL.gguf .weights/NAME.part`, NAME =
#     $CHUNK_NAME: `smol` for SmolLM2, else the fetch name) are gathered into $WORK/chunks over one or
#     more calls; once MODEL's (and DRAFT_MODEL's) chunks (NAME.part*) join into a file whose sha256
#     matches, `specjax fetch $MODEL --from-file` installs it into $SPECJAX_HOME;
#   - files an earlier machine returned ($CARRY_PERSIST/, e.g. a data tar or a head) seed $PERSIST;
#     a file that travelled in pieces (`split -b 10M -d F F.part; stat -c %s F > F.size`) is joined
#     once the pieces' sizes add up; files under $CARRY_PERSIST/assets/ are then put at the same path
#     under assets/ of the checkout where it lacks them (heads the configs name, carried over calls).
# Environment (defaults in brackets): WORK [$HOME/specjax-gpu], SPECJAX_HOME [$WORK/home],
# SPECJAX_DATA [$WORK/data], SITE [$WORK/site], PERSIST [$WORK/persist], WHEELS [.whl],
# DATA_CARRY [.data], CHUNKS [.weights/*.part*], MODEL [smollm2-135m-instruct], DRAFT_MODEL [none],
# CARRY_PERSIST [.gpucarry/persist], OUT (required: the folder whose files come back).
# SMOKE=1: a CPU-sized run on this machine (nothing installed; WORK defaults to out/smoke).
# Defines: device_kind, bars (progress bars filtered), timed_run TAG SECONDS CMD..., spec_fields,
# return_jax_cache [MAX_MB] (the compile cache back in $OUT; JAX_CACHE_CARRY [.gpucarry/jax_cache] seeds it).
# Example:  OUT=/tmp/o bash experiments/gpu/bootstrap.sh python experiments/bench_decode.py --batch 1 8 --out /tmp/o/decode.json
set -e
cd "$(git rev-parse --show-toplevel 2>/dev/null || dirname "${BASH_SOURCE[0]}")"
if [ "${SMOKE:-0}" = 1 ]; then WORK=${WORK:-$PWD/out/smoke}; else WORK=${WORK:-$HOME/specjax-gpu}; fi
export SPECJAX_HOME=${SPECJAX_HOME:-$WORK/home} SPECJAX_DATA=${SPECJAX_DATA:-$WORK/data}
SITE=${SITE:-$WORK/site}; PERSIST=${PERSIST:-$WORK/persist}; MODEL=${MODEL:-smollm2-135m-instruct}
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
export SPECJAX_GIT_REV=${SPECJAX_GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
: "${OUT:?set OUT to the folder whose files come back}"
mkdir -p "$OUT" "$WORK/chunks" "$SPECJAX_HOME" "$SPECJAX_DATA" "$PERSIST"
if [ "${SMOKE:-0}" != 1 ]; then
  if [ -d "${WHEELS:-.whl}" ] && [ ! -f "$SITE/.installed" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${WHEELS:-.whl}"/*.whl
    touch "$SITE/.installed"
  fi
  [ -d "${DATA_CARRY:-.data}" ] && cp --update=none "${DATA_CARRY:-.data}"/*.jsonl "$SPECJAX_DATA/" 2>/dev/null || true
  for f in "${DATA_CARRY:-.data}"/*.jsonl.gz; do             # gzipped data files, unpacked once
    if [ -f "$f" ] && [ ! -f "$SPECJAX_DATA/$(basename "$f" .gz)" ]; then gunzip -c "$f" > "$SPECJAX_DATA/$(basename "$f" .gz)"; fi
  done
  for f in ${CHUNKS:-.weights/*.part*}; do [ -f "$f" ] && cp --update=none "$f" "$WORK/chunks/"; done
  for m in $MODEL ${DRAFT_MODEL:-}; do
    if [ "$m" = smollm2-135m-instruct ]; then name=${CHUNK_NAME:-smol}; else name=$m; fi
    if [ ! -f "$SPECJAX_HOME/.$m" ] && ls "$WORK/chunks/$name".part* >/dev/null 2>&1; then
      cat "$WORK/chunks/$name".part* > "$WORK/model.gguf"        # the sha256 check says whether every chunk is here
      if python3 -m specjax.cli fetch "$m" --from-file "$WORK/model.gguf" 2>/dev/null; then
        touch "$SPECJAX_HOME/.$m"
      else
        echo "[bootstrap] $m: chunks incomplete so far"
      fi
      rm -f "$WORK/model.gguf"
    fi
  done
fi
# a compile cache an earlier machine returned (`return_jax_cache` below), carried back as
# $JAX_CACHE_CARRY/jax_cache.tgz.part*: unpacked once into $SPECJAX_HOME, so servers and benchmarks
# load what that machine compiled (XLA keys each entry by program, options, jax and device)
JAX_CACHE_CARRY=${JAX_CACHE_CARRY:-.gpucarry/jax_cache}
if ls "$JAX_CACHE_CARRY"/jax_cache.tgz.part* >/dev/null 2>&1 && [ ! -f "$SPECJAX_HOME/.jax_cache_seeded" ]; then
  cat "$JAX_CACHE_CARRY"/jax_cache.tgz.part* | tar xzf - -C "$SPECJAX_HOME" && touch "$SPECJAX_HOME/.jax_cache_seeded"
  echo "[bootstrap] compile cache seeded: $(ls "$SPECJAX_HOME/jax_cache" | wc -l) entries"
fi
# the compile cache into $OUT as jax_cache.tgz.partNN of 15 MB (what comes back: at most 8 files of
# 16 MiB, 64 MiB in all), when it packs into MAX_MB [45]; carry the pieces back in JAX_CACHE_CARRY
return_jax_cache() {
  local max=${1:-45} tgz=$WORK/jax_cache.tgz
  [ -d "$SPECJAX_HOME/jax_cache" ] || { echo "[bootstrap] no compile cache to return"; return 0; }
  tar czf "$tgz" -C "$SPECJAX_HOME" jax_cache
  local mb=$(( $(stat -c %s "$tgz") / 1048576 ))
  if [ "$mb" -gt "$max" ]; then echo "[bootstrap] compile cache is $mb MB (> $max): not returned"; return 0; fi
  split -b 15M -d "$tgz" "$OUT/jax_cache.tgz.part" && echo "[bootstrap] compile cache returned: $mb MB"
}
CARRY_PERSIST=${CARRY_PERSIST:-.gpucarry/persist}
[ -d "$CARRY_PERSIST" ] && cp -rn "$CARRY_PERSIST/." "$PERSIST/"
while IFS= read -r size; do
  f=${size%.size}
  [ -f "$f" ] && continue
  if [ "$(cat "$f".part* 2>/dev/null | wc -c)" = "$(cat "$size")" ]; then cat "$f".part* > "$f" && rm -f "$f".part*; fi
done < <(find "$PERSIST" -name '*.size' -type f)
# heads carried as $CARRY_PERSIST/assets/PATH (whole or in pieces) are put at assets/PATH of this
# checkout when it lacks them, where configs name them (a tracked file kept out of a call's tree)
if [ -d "$PERSIST/assets" ]; then
  while IFS= read -r f; do
    [ -f "$f" ] || { mkdir -p "$(dirname "$f")" && cp "$PERSIST/$f" "$f"; }
  done < <(cd "$PERSIST" && find assets -type f ! -name '*.size' ! -name '*.part[0-9]*')
fi
device_kind() { python3 -c 'import jax; print(jax.devices()[0].device_kind)'; }
# progress bars: keep their last state and lines that are not bars; an error printed on an
# unfinished bar's line is split off first, so it is not dropped
bars() { tr '\r' '\n' | sed -u 's/\(error: \|Traceback\)/\n\1/' | grep --line-buffered -v -E '^\s*$' \
  | grep --line-buffered -E '100%\||^[^|]*$|error: |Error' || true; }
# a command under a timeout, bars filtered, exit status and time logged; never fails
timed_run() {
  local tag=$1 limit=$2 t0=$(date +%s)
  shift 2
  set +e
  timeout "$limit" "$@" 2>&1 | bars
  echo "[$tag] exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
  set -e
}
# fields of a training spec: spec_fields KIND CONFIG FIELD... (e.g. dflash cfg.yaml out_dir drafter.init_from)
spec_fields() {
  python3 -c "import sys; from specjax.train.$1 import load_spec; s = load_spec(sys.argv[1]); print(*[eval('s.' + f) for f in sys.argv[2:]])" "${@:2}"
}
echo "[bootstrap] rev $SPECJAX_GIT_REV; $(for m in $MODEL ${DRAFT_MODEL:-}; do echo -n "$m: $([ -f "$SPECJAX_HOME/.$m" ] && echo installed || echo 'not from chunks'); "; done)persist: $(ls "$PERSIST" | tr '\n' ' ')"
if [ "${BASH_SOURCE[0]}" = "$0" ] && [ $# -gt 0 ]; then exec "$@"; fi
