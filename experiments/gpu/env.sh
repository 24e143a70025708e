# Sourced by every experiments/gpu/*.sh stage on the lent GPU machine (no network there).
# Installs the carried wheels once, gathers the carried weight chunks, installs the SmolLM2 GGUF
# (sha256-checked) once all chunks are there, whatever their number. Chunks: `split -b 47M -d
# SmolLM2-135M-Instruct.Q4_1.gguf .weights3/smol.part` here, one per call, with assets/ taken out of
# the index for the GPU calls (experiments/README.md: the working tree + carried files must stay
# under 64 MiB, and the trained heads under assets/ are ~38 MB).
set -e
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECJAX_HOME=/root/h SPECJAX_DATA=/root/data
export SPECJAX_GIT_REV=${SPECJAX_GIT_REV:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
mkdir -p /root/w /root/h /root/data
if [ -d .whl ] && [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  touch /tmp/site/.installed
fi
[ -d .data ] && cp --update=none .data/*.jsonl /root/data/ 2>/dev/null || true
for f in .weights3/smol.part*; do [ -f "$f" ] && cp --update=none "$f" /root/w/; done
if [ ! -f /root/h/.smollm2 ] && ls /root/w/smol.part* >/dev/null 2>&1; then
  cat /root/w/smol.part* > /root/w/smol.gguf      # the sha256 check says whether every chunk is there
  if python3 -m specjax.cli fetch smollm2-135m-instruct --from-file /root/w/smol.gguf 2>/dev/null; then
    touch /root/h/.smollm2
  else
    echo "[env] SmolLM2 chunks incomplete so far"
  fi
fi
echo "[env] rev $SPECJAX_GIT_REV; chunks: $(ls /root/w | tr '\n' ' '); smollm2: $([ -f /root/h/.smollm2 ] && echo installed || echo missing)"
