# Session B: EAGLE-3 (issue 8) data + training + evaluation; the head is kept on the machine for
# the DFlash side-by-side run (stage_dflash.sh) in the next call.
source experiments/gpu/env.sh
OUT=$OUT bash experiments/gpu_eagle3.sh 2>&1 | grep -v "it/s\]$" | tail -80
mkdir -p /root/persist/eagle3 && cp out/eagle3/export/eagle3_head.* /root/persist/eagle3/ 2>/dev/null || true
