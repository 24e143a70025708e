# Issue 7, second MTP head, call 1 of 3: the self-distillation data of configs/mtp_smollm2_gpu2.yaml
# (3072 + 1024 magpie queries written by the target, greedy / sampled answers, alpaca, humaneval,
# capped gsm8k, references), ~4 minutes on an H200, capped at DATA_TIMEOUT (480 s) so the call ends
# within ~8.5 minutes. The data folders go to /root/persist/mtp2_data.tar for stage_mtp2_train.sh
# (also after a timeout: the build is resumable, and the train stage finishes it first). Into $OUT:
# the log, the magpie query caches (to read what the target asked itself), a data summary.
#   bash experiments/gpu/stage_mtp2_data.sh            # GPU
#   SMOKE=1 bash experiments/gpu/stage_mtp2_data.sh    # CPU-sized (configs/mtp_smollm2_gpu2_smoke.yaml)
source experiments/gpu/stage_mtp2_common.sh
{
  echo "[mtp2 data] rev $SPECJAX_GIT_REV, config $CFG, $(python3 -c 'import jax; print(jax.devices()[0].device_kind)')"
  [ -f "$PERSIST/mtp2_data.tar" ] && tar xf "$PERSIST/mtp2_data.tar" && echo "[mtp2 data] resumed from $PERSIST"
  t0=$(date +%s)
  set +e
  timeout "${DATA_TIMEOUT:-480}" python3 -m specjax.cli train data --config "$CFG" 2>&1 | bars
  rc=${PIPESTATUS[0]}
  set -e
  echo "[mtp2 data] exit $rc after $(( $(date +%s) - t0 )) s"
  persist_data
  if [ "$rc" = 0 ]; then touch "$PERSIST/mtp2_data.complete"; else rm -f "$PERSIST/mtp2_data.complete"; fi
  python3 - "$CFG" "$rc" "$OUT/mtp2_data_summary.json" $DATA_DIRS <<'PY' || echo "[mtp2 data] summary failed"
import json, sys
from pathlib import Path
from specjax.bench.env import device_info, git_revision
cfg, rc, out, dirs = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
res = {"config": cfg, "exit": rc, "git_revision": git_revision(), "device": device_info(), "folders": {}}
for d in map(Path, dirs):
  man = json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").exists() else {"shards": []}
  rows = sum(s["rows"] for s in man["shards"])
  res["folders"][str(d)] = {"shards": len(man["shards"]), "rows": rows,
                            "response_tokens": sum(s["response_tokens"] for s in man["shards"])}
  for cache in sorted(d.glob("magpie_prompts_*.jsonl")):
    batches = [json.loads(l) for l in cache.read_text().splitlines()[1:]]
    rej = {}
    for b in batches:
      for k, v in b["rejected"].items():
        rej[k] = rej.get(k, 0) + v
    kept = sum(len(b["queries"]) for b in batches)
    res["folders"][str(d)][cache.name] = {"batches": len(batches), "kept": kept, "rejected": rej}
out.write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps(res["folders"], indent=1))
PY
  [ -f "$OUT/mtp2_data_summary.json" ] || echo "[mtp2 data] no summary"
  for d in $DATA_DIRS; do
    for f in "$d"/magpie_prompts_*.jsonl; do [ -f "$f" ] && cp "$f" "$OUT/$(basename "$d")_$(basename "$f")"; done
  done
  # token shards only (no taps): small enough to come back, so a later machine can train on them
  [ -f "$PERSIST/mtp2_data.tar" ] && [ "$(stat -c %s "$PERSIST/mtp2_data.tar")" -lt 16000000 ] && cp "$PERSIST/mtp2_data.tar" "$OUT/"
  [ -f "$PERSIST/mtp2_data.complete" ] && touch "$OUT/mtp2_data.complete"
  ls -la "$OUT"
} 2>&1 | tee "$OUT/stage_mtp2_data.log"
