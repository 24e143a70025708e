#!/usr/bin/env bash
# Self-distillation data or a head's training on the GPU machine, resumable across calls/machines.
# Parameters: KIND (data | mtp | eagle3 | dflash), CONFIG (a configs/train_*.yaml spec).
#   data: `specjax train data` (the config's data folders); KIND = a head: `specjax train KIND`
#   (builds what data the spec still lacks, trains, exports, scores held-out rows where it has them).
# Around the command: every data tar in $PERSIST/data/ is restored first (one data build serves
# several heads: the EAGLE-3 and DFlash GPU specs train on the MTP spec's folders); checkpoints in
# $PERSIST/NAME_ckpt.tar are restored (a run cut by TIMEOUT resumes when called again); a warm start
# (init_from: out/PREV/export/F) missing here is taken from $PERSIST/PREV/; a HumanEval source named
# *humaneval_train.jsonl that is missing is written (HumanEval without its first 16 prompts, the
# evaluation set). After it: the spec's data folders -> $PERSIST/data/NAME.tar, checkpoints ->
# $PERSIST/NAME_ckpt.tar, the export -> $PERSIST/<out_dir name>/ and $OUT (files over 15 MiB in
# 15 MiB parts: `cat F.part* > F`), metrics.jsonl / training_curve.png / summary.json and the log ->
# $OUT; for data, a summary of the folders -> $OUT/data_summary.json (experiments/data_summary.py).
# Environment: TIMEOUT [540] seconds, TRAIN_ARGS (extra flags, e.g. --no-data), SMOKE=1 (CPU-sized,
# use the config's _smoke twin); the rest as in bootstrap.sh (OUT required).
# Example:  OUT=/tmp/o bash experiments/gpu/train_head.sh data configs/train_mtp_smollm2_gpu.yaml
#           OUT=/tmp/o bash experiments/gpu/train_head.sh mtp configs/train_mtp_smollm2_gpu.yaml
source "$(dirname "$0")/bootstrap.sh"
KIND=${1:?usage: train_head.sh data|mtp|eagle3|dflash CONFIG}; CONFIG=${2:?usage: train_head.sh KIND CONFIG}
HEAD=$(basename "$CONFIG" | sed -n 's/^train_\(mtp\|eagle3\|dflash\)_.*/\1/p')
[ -n "$HEAD" ] || { echo "[train] $CONFIG: not a configs/train_<mtp|eagle3|dflash>_*.yaml spec"; exit 2; }
read -r NAME OUTDIR EXPORT INIT DIRS <<<"$(python3 - "$HEAD" "$CONFIG" <<'PY'
import importlib, sys
s = importlib.import_module(f"specjax.train.{sys.argv[1]}").load_spec(sys.argv[2])
init = getattr(getattr(s, "head", None) or getattr(s, "drafter", None), "init_from", None) or "-"
dirs = [s.data.dir] + [e.dir for e in s.extra_data] + [e.dir for e in getattr(s, "heldout_data", ())]
srcs = [src.name for d in [s.data, *s.extra_data] for src in d.sources if src.name.endswith("humaneval_train.jsonl")]
print(s.name, s.out_dir, s.export, init, " ".join(dirs + [f"humaneval_train:{p}" for p in srcs]))
PY
)"
LOG="$OUT/train_${KIND}_$NAME.log"
{
  echo "[train] $KIND $CONFIG ($NAME), rev $SPECJAX_GIT_REV, $(device_kind)"
  for t in "$PERSIST"/data/*.tar; do [ -f "$t" ] && tar xf "$t" && echo "[train] restored $t"; done
  [ -f "$PERSIST/${NAME}_ckpt.tar" ] && tar xf "$PERSIST/${NAME}_ckpt.tar" && echo "[train] checkpoints restored"
  for d in $DIRS; do
    case $d in humaneval_train:*) f=${d#humaneval_train:}; [ -f "$f" ] || { mkdir -p "$(dirname "$f")"; python3 - "$f" <<'PY'
import sys
from specjax.bench.prompts import resolve
lines = [ln for ln in open(resolve("humaneval")) if ln.strip()]
open(sys.argv[1], "w").writelines(lines[16:])
PY
      echo "[train] wrote $f"; } ;; esac
  done
  if [ "$INIT" != - ] && [ ! -f "$INIT" ]; then
    prev=$(echo "$INIT" | sed -n 's#^out/\([^/]*\)/export/.*#\1#p')
    [ -n "$prev" ] && ls "$PERSIST/$prev"/*.safetensors >/dev/null 2>&1 && mkdir -p "$(dirname "$INIT")" && cp "$PERSIST/$prev"/* "$(dirname "$INIT")/"
    [ -f "$INIT" ] && echo "[train] warm start $INIT" || echo "[train] no $INIT here nor in $PERSIST/$prev"
  fi
  timed_run train "${TIMEOUT:-540}" python3 -m specjax.cli train "$KIND" --config "$CONFIG" $TRAIN_ARGS
  have=""; for d in $DIRS; do case $d in humaneval_train:*) ;; *) [ -d "$d" ] && have="$have $d";; esac; done
  mkdir -p "$PERSIST/data"
  [ -n "$have" ] && tar cf "$PERSIST/data/$NAME.tar" $have && echo "[train] data folders -> $PERSIST/data/$NAME.tar"
  if [ "$KIND" = data ]; then
    python3 experiments/data_summary.py --config "$CONFIG" --out "$OUT/data_summary.json" $have || echo "[train] no data summary"
  else
    [ -d "$OUTDIR/checkpoints" ] && tar cf "$PERSIST/${NAME}_ckpt.tar" "$OUTDIR/checkpoints" $(ls "$OUTDIR"/metrics.jsonl 2>/dev/null)
    if [ -f "$EXPORT" ]; then
      keep="$PERSIST/$(basename "$OUTDIR")"; mkdir -p "$keep"
      cp "$(dirname "$EXPORT")"/* "$keep/" && cp "$(dirname "$EXPORT")"/* "$OUT/"
    else
      echo "[train] no export yet (stopped early: call again to resume)"
    fi
    for f in metrics.jsonl training_curve.png summary.json heldout.jsonl; do [ -f "$OUTDIR/$f" ] && cp "$OUTDIR/$f" "$OUT/"; done
    for f in "$OUT"/*.safetensors; do
      [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt 15728640 ] && split -b 15M -d "$f" "$f.part" && rm "$f"
    done
  fi
  ls -la "$OUT"
} 2>&1 | tee "$LOG"
