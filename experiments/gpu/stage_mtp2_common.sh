# Sourced by experiments/gpu/stage_mtp2_{data,train,eval}.sh: the GPU environment (env.sh), or with
# SMOKE=1 a CPU-sized run here (configs/mtp_smollm2_gpu2_smoke.yaml, persisted under /tmp).
if [ "${SMOKE:-0}" = 1 ]; then
  set -e
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
  export SPECJAX_GIT_REV=${SPECJAX_GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  CFG=${CFG:-configs/mtp_smollm2_gpu2_smoke.yaml}
  PERSIST=${PERSIST:-/tmp/mtp2_smoke_persist}
  OUT=${OUT:-/tmp/mtp2_smoke_out}
else
  source experiments/gpu/env.sh
  CFG=${CFG:-configs/mtp_smollm2_gpu2.yaml}
  PERSIST=${PERSIST:-/root/persist}
fi
: "${OUT:?set OUT to the folder whose files come back}"
mkdir -p "$OUT" "$PERSIST"
# a fresh machine: what an earlier machine's stages returned (the data tar, heads) can be carried in
# .gpucarry/persist/ (ignored by git, named in the call's carry) and seeds $PERSIST
[ -d .gpucarry/persist ] && cp -rn .gpucarry/persist/. "$PERSIST/" && echo "[mtp2] seeded $PERSIST from .gpucarry/persist: $(ls .gpucarry/persist | tr '\n' ' ')"
# a file too big for one call travels in parts (`split -b 10M -d F F.part` here, `stat -c %s F > F.size`),
# one call each; it is joined once every part is there (their sizes add up to F.size)
assemble_parts() {   # assemble_parts DIR
  local size f
  for size in "$1"/*.size; do
    [ -f "$size" ] || continue
    f=${size%.size}
    [ -f "$f" ] && continue
    if [ "$(cat "$f".part* 2>/dev/null | wc -c)" = "$(cat "$size")" ]; then
      cat "$f".part* > "$f" && rm -f "$f".part* && echo "[parts] joined $f"
    else
      echo "[parts] $f: not every part is here yet"
    fi
  done
}
for d in "$PERSIST"/*/; do assemble_parts "$d"; done
# the config's data folders, out_dir and export, e.g. "out/mtp_gpu2/data_greedy out/mtp_gpu2/data_ref ..."
read -r OUTDIR EXPORT DATA_DIRS <<<"$(python3 -c "
from specjax.train.mtp import load_spec
s = load_spec('$CFG')
print(s.out_dir, s.export, ' '.join([s.data.dir] + [e.dir for e in s.extra_data]))")"
# progress bars: keep their last state only (and lines that are not bars); an error printed on the
# line of an unfinished bar (tqdm leaves no newline) is split off first, so it is not dropped
bars() { tr '\r' '\n' | sed -u 's/\(error: \|Traceback\)/\n\1/' | grep --line-buffered -v -E '^\s*$' \
  | grep --line-buffered -E '100%\||^[^|]*$|error: |Error' || true; }
# a training config's fields, space-separated: spec_fields MODULE CONFIG FIELD... (e.g. eagle3 cfg.yaml out_dir export)
spec_fields() {
  python3 -c "import sys; from specjax.train.$1 import load_spec; s = load_spec(sys.argv[1]); print(*[eval('s.' + f) for f in sys.argv[2:]])" "${@:2}"
}
# a command under a timeout, its progress bars filtered, its exit status and time logged; never fails
timed_run() {   # timed_run TAG SECONDS CMD...
  local tag=$1 limit=$2 t0=$(date +%s)
  shift 2
  set +e
  timeout "$limit" "$@" 2>&1 | bars
  echo "[$tag] exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s"
  set -e
}
# the data folders built so far -> $PERSIST/mtp2_data.tar (restored by the next stage with `tar xf`)
persist_data() {
  local have=""
  for d in $DATA_DIRS; do [ -d "$d" ] && have="$have $d"; done
  if [ -n "$have" ]; then tar cf "$PERSIST/mtp2_data.tar" $have; else echo "[mtp2] no data folder to persist"; fi
}
# the data folders of stage_mtp2_data.sh, restored from $PERSIST (a training stage's first step)
restore_data() {   # restore_data TAG
  [ -f "$PERSIST/mtp2_data.tar" ] || { echo "[$1] no $PERSIST/mtp2_data.tar: run stage_mtp2_data.sh first (or carry it in .gpucarry/persist/)"; exit 1; }
  tar xf "$PERSIST/mtp2_data.tar"
}
# a warm start's file, when the config's path is missing here: from $PERSIST/NAME (an earlier stage's)
seed_init() {   # seed_init TAG INIT_PATH NAME
  local tag=$1 init=$2 name=$3
  if [ ! -f "$init" ] && ls "$PERSIST/$name"/*.safetensors >/dev/null 2>&1; then
    mkdir -p "$(dirname "$init")" && cp "$PERSIST/$name"/* "$(dirname "$init")/"
  fi
  [ -f "$init" ] && echo "[$tag] starting from $init" || echo "[$tag] no $init: from scratch"
}
# a trained head's files -> $PERSIST/NAME and $OUT; its metrics, curve and summary -> $OUT/PREFIX*
export_trained() {   # export_trained TAG EXPORT OUTDIR NAME PREFIX
  local tag=$1 export=$2 outdir=$3 name=$4 prefix=$5
  if [ -f "$export" ]; then
    mkdir -p "$PERSIST/$name" && cp "${export%.safetensors}".* "$PERSIST/$name/" && cp "${export%.safetensors}".* "$OUT/"
  else
    echo "[$tag] no export (training stopped early)"
  fi
  for f in metrics.jsonl training_curve.png; do [ -f "$outdir/$f" ] && cp "$outdir/$f" "$OUT/$prefix$f"; done
  [ -f "$outdir/summary.json" ] && cp "$outdir/summary.json" "$OUT/${prefix}train_summary.json"
  return 0
}
