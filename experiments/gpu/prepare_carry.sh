#!/usr/bin/env bash
# Here, not on the GPU machine: everything a SmolLM2 run on a fresh lent machine needs, laid out as
# three carries of < 64 MiB each (with the trimmed tree, `trim_tree.sh min`), to be sent as three
# calls back to back on one machine:
#   .gpucarry/c4: weight chunk 0                      carry [".whl", ".data", ".gpucarry/c4"]
#   .gpucarry/c5: weight chunk 1 + the MTP head       carry [".whl", ".data", ".gpucarry/c5"]
#   .gpucarry/c6: the EAGLE-3 head + DFlash drafter   carry [".whl", ".data", ".gpucarry/c6"]
# and the wheels the machine lacks (.whl) and MT-bench (.data). Each call's command first copies its
# part into the machine's work folder (bootstrap.sh installs the model once both chunks are there and
# puts the heads at their assets/ paths on every later call):
#   W=~/specjax-gpu; mkdir -p $W/chunks $W/persist; cp .gpucarry/c4/smol.part* $W/chunks/ 2>/dev/null;
#   cp -r .gpucarry/c4/persist/. $W/persist/ 2>/dev/null; export CHUNKS=none CARRY_PERSIST=none; bash experiments/gpu/bootstrap.sh ...
# (c5 / c6 likewise). Needs the network (pip download, specjax fetch). Environment: PY [.venv/bin/python].
set -e
cd "$(git rev-parse --show-toplevel)"
PY=${PY:-.venv/bin/python}
for p in /.whl/ /.weights/ /.gpucarry/ /.data/ /out/; do grep -qx "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
mkdir -p .whl .data .weights
[ -n "$(ls .whl/*.whl 2>/dev/null)" ] || "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl gguf tensorboardX starlette uvicorn
gguf=$("$PY" -m specjax.cli fetch smollm2-135m-instruct 2>/dev/null | tail -1)
data=$("$PY" -m specjax.cli fetch mt_bench 2>/dev/null | tail -1)
cp "$data" .data/
rm -f .weights/smol.part*
split -b 47M -d "$gguf" .weights/smol.part
rm -rf .gpucarry/c4 .gpucarry/c5 .gpucarry/c6
mkdir -p .gpucarry/c4 .gpucarry/c5/persist/assets/smollm2/mtp .gpucarry/c6/persist/assets/smollm2/eagle3 \
  .gpucarry/c6/persist/assets/smollm2/dflash
cp .weights/smol.part00 .gpucarry/c4/
cp .weights/smol.part01 .gpucarry/c5/
git show HEAD:assets/smollm2/mtp/mtp_head.safetensors > .gpucarry/c5/persist/assets/smollm2/mtp/mtp_head.safetensors
git show HEAD:assets/smollm2/eagle3/eagle3_head.safetensors > .gpucarry/c6/persist/assets/smollm2/eagle3/eagle3_head.safetensors
for f in dflash.safetensors dflash-2.safetensors; do     # dflash.safetensors names dflash-2 as its shard
  git show "HEAD:assets/smollm2/dflash/$f" > ".gpucarry/c6/persist/assets/smollm2/dflash/$f"
done
du -sh .whl .data .gpucarry/c4 .gpucarry/c5 .gpucarry/c6
