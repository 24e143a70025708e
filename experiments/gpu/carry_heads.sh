#!/usr/bin/env bash
# Here, not on the GPU machine: cut heads (or any tracked files under assets/) into pieces under
# .gpucarry/persist/assets/, so that calls can carry them a few pieces at a time beside a weight
# chunk; bootstrap.sh joins the pieces once all have arrived on one machine and puts each file back
# at its assets/ path there. Prints each piece's path and size, for the calls' carry lists.
# Environment: SIZE [4500000] bytes per piece.
# Example:  bash experiments/gpu/carry_heads.sh assets/smollm2/dflash/dflash.safetensors assets/smollm2/dflash/dflash-2.safetensors
set -e
cd "$(git rev-parse --show-toplevel)"
for f in "$@"; do
  case "$f" in assets/*) ;; *) echo "error: $f is not under assets/" >&2; exit 2;; esac
  [ -f "$f" ] || { echo "error: no file $f" >&2; exit 2; }
  dir=.gpucarry/persist/$(dirname "$f")
  name=$(basename "$f")
  mkdir -p "$dir"
  rm -f "$dir/$name".part* "$dir/$name.size"
  split -b "${SIZE:-4500000}" -d "$f" "$dir/$name.part"
  stat -c %s "$f" > "$dir/$name.size"
  ls -l "$dir/$name".part* "$dir/$name.size" | awk '{print $9, $5}'
done
