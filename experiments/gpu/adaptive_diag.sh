#!/usr/bin/env bash
# Why width-0 rounds cost more inside the adaptive program of every width than in a program of width
# 0 alone (experiments/README, "Where MTP's batch-8 loss goes"), in one call on the GPU machine:
#   weightless (random SmolLM2-shaped weights; no chunks needed):
#   1. adaptive_hlo.py: the compiled programs (plain decoding, width 0 alone, every width) with their
#      loop bodies' copies, >= 1 MB ops and instruction counts; XLA's own dump of those modules
#      (after optimizations, and the thunk sequences: which loop bodies became command buffers)
#      comes back as $OUT/adaptive_hlo_dump.tgz;
#   2. adaptive_overhead.py --trace: ms per token and per call of the three programs, and each
#      program's long run under the profiler (command buffers kept): kernels per token, busy, gaps;
#   with the model installed (STAGE=probe, after the weight chunks travelled):
#   3. adaptive_probe.py --trace on the heads' batch-8 config (MTP: as configured, width 0 alone,
#      the all-widths program held at width 0), then the model-free config (suffix, ngram_mod).
# Environment: STAGE [weightless] (weightless | probe | all), CAPACITY ["2048 512"], seconds per step:
# T_HLO [180], T_OVERHEAD [320], T_PROBE [280] (each of the two probes); the rest as in bootstrap.sh
# (OUT required). The Python steps write their JSON as they go, so a step cut by its limit keeps
# the rows it finished.
# SMOKE=1: the CPU dry run (tiny model, short runs; the probe stage needs the SmolLM2 weights).
# Example:  OUT=/tmp/o SMOKE=1 bash experiments/gpu/adaptive_diag.sh
source "$(dirname "$0")/bootstrap.sh"
STAGE=${STAGE:-weightless}
CAPACITY=${CAPACITY:-"2048 512"}
SIZE=""
[ "${SMOKE:-0}" = 1 ] && SIZE="--tiny" && CAPACITY="256"
echo "[diag] stage $STAGE on $(device_kind)"
if [ "$STAGE" != probe ]; then
  dump=$WORK/xla_dump
  rm -rf "$dump"
  # shellcheck disable=SC2086
  XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$dump --xla_dump_hlo_module_re=.*adaptive_run.*|.*decode_loop.*" \
    timed_run hlo "${T_HLO:-180}" python3 experiments/adaptive_hlo.py $SIZE --capacity ${CAPACITY%% *} --dump "$dump/programs" \
    --out "$OUT/adaptive_hlo.json"
  (cd "$dump" && find . \( -name "*after_optimizations.txt" -o -name "*thunk*" -o -path "./programs/*" \) -print0 \
    | tar czf "$OUT/adaptive_hlo_dump.tgz" --null -T -) || true
  short=""; [ "${SMOKE:-0}" = 1 ] && short="--short 8 --long 16 --repeats 1"
  # shellcheck disable=SC2086
  timed_run overhead "${T_OVERHEAD:-320}" python3 experiments/adaptive_overhead.py $SIZE $short --speculators mtp \
    --capacity $CAPACITY --segments 16 --repeats 3 --trace --out "$OUT/adaptive_overhead_trace.json"
fi
if [ "$STAGE" != weightless ]; then
  timed_run probe_heads "${T_PROBE:-280}" python3 experiments/adaptive_probe.py --config configs/bench_adaptive_heads_smollm2_b8.yaml \
    --methods mtp --variants configured width0 width0_all --repeats 3 --trace --out "$OUT/adaptive_probe_heads_b8.json"
  timed_run probe_modelfree "${T_PROBE:-280}" python3 experiments/adaptive_probe.py \
    --config configs/bench_adaptive_modelfree_smollm2_b8.yaml --methods suffix ngram_mod --repeats 3 --trace \
    --out "$OUT/adaptive_probe_modelfree_b8.json"
fi
ls -la "$OUT"
