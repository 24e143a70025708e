# Session B: DFlash (issue 9) data + training + evaluation, side by side with the GPU MTP head and
# the EAGLE-3 head trained in the previous call.
source experiments/gpu/env.sh
EAGLE3_HEAD=/root/persist/eagle3/eagle3_head.safetensors DATA_S=${DATA_S:-60} TRAIN_S=${TRAIN_S:-150} \
  EVAL_S=${EVAL_S:-200} OUT=$OUT bash experiments/gpu_dflash.sh 2>&1 | grep -v "it/s\]$" | tail -80
