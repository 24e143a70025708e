#!/usr/bin/env bash
# llama.cpp built from source with CUDA, run beside specjax on the same GPU, same GGUF (SmolLM2-135M-
# Instruct Q4_1), same MT-bench prompts, batch 1, greedy (issue 25 goal 5): llama-bench (flash
# attention off / on), llama-completion, llama-speculative-simple with n-gram speculation, and
# `specjax bench` plain / ngram_simple (tuned, and at llama.cpp's n, m), merged into one JSON:
# $OUT/llamacpp_side_by_side.json (experiments/llamacpp_side_by_side.py says what runs and how it is timed).
#
# Here, once: pack what travels into .gpucarry/llamacpp/ (git-ignored; ~50 MiB in all, carried piecewise):
#   PYTHON=.venv/bin/python bash experiments/gpu/llamacpp.sh --pack [llama_cpp_python-X.tar.gz]
#     llama.cpp.tar.gz   llama.cpp's source from the llama-cpp-python sdist (pip download when no sdist
#                        is given), stripped to what llama-bench, llama-completion and
#                        llama-speculative-simple need with the CUDA backend (~2.5 MB)
#     prompts.jsonl      the MT-bench first turns both sides run
#     whl/               the gguf wheel (the GPU image lacks it)
#     weights/smol.partNN  the fetched SmolLM2 GGUF in two 47 MiB chunks
# On the GPU machine: two calls back to back (the machine keeps $HOME while warm, ~30 s between calls),
# each carrying llama.cpp.tar.gz, prompts.jsonl, whl and ONE chunk; assets/ must not travel (55 MB):
#   call 1 (weights/smol.part00): builds llama.cpp into $LLAMA_HOME (~6 min on an H100); no model yet
#   call 2 (weights/smol.part01): the GGUF joins and installs; llama.cpp then specjax run (~5-6 min)
# Resumable: the build is skipped when its binaries exist (an interrupted build continues), finished
# llama.cpp runs and specjax rows are kept in $WORK/llamacpp; a call that finds both chunks and the
# build runs everything; a cold machine in between just repeats the build.
# Draft-model speculation (Qwen2.5-Coder 0.5B -> 1.5B): pack with MODEL=qwen2.5-coder-1.5b-instruct
# DRAFT_MODEL=qwen2.5-coder-0.5b-instruct CHUNK_SIZE=60M (26 chunks); on the GPU a first call with
# DETACH_BUILD=1 starts the build in the background and returns, one call per further chunk copies
# it to $WORK/chunks, and a last call with the same MODEL / DRAFT_MODEL installs both and runs
# (experiments/README.md has the calls).
# Environment: BUDGET [560] seconds for this script (the tool allows 600); LLAMA_HOME [$HOME/llamacpp]
# (outside the checkout); JOBS [16]; PROMPTS [.gpucarry/llamacpp/prompts.jsonl]; MAX_NEW [256];
# DTYPE [bfloat16]; EXTRA (more flags for llamacpp_side_by_side.py run, e.g. "--limit 2");
# MODEL [smollm2-135m-instruct], DRAFT_MODEL [none: the n-gram grid], CHUNK_SIZE [47M] (--pack),
# DETACH_BUILD [0]; WHEELS / CHUNKS default to .gpucarry/llamacpp/{whl,weights/*.part*}; the rest as in bootstrap.sh.
# Example (device tool): SPECJAX_GIT_REV=abc1234 bash experiments/gpu/llamacpp.sh
#   with carry [".gpucarry/llamacpp/llama.cpp.tar.gz", ".gpucarry/llamacpp/prompts.jsonl",
#               ".gpucarry/llamacpp/whl", ".gpucarry/llamacpp/weights/smol.part00"], then ...part01
set -e
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$HERE/../.."
T0=$(date +%s)
BUDGET=${BUDGET:-560}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
CARRY=.gpucarry/llamacpp
MODEL=${MODEL:-smollm2-135m-instruct}
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
TARGETS="llama-bench llama-completion llama-speculative-simple"

# --- here: pack the source, prompts, wheel and weight chunks ------------------------------------------
pack() {
  local py=${PYTHON:-python3} sdist=${1:-}
  PACK_TMP=$(mktemp -d)
  trap 'rm -rf "$PACK_TMP"' EXIT
  local tmp=$PACK_TMP
  mkdir -p "$CARRY/whl" "$CARRY/weights"
  if [ -z "$sdist" ]; then
    "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$tmp"
    sdist=$(ls "$tmp"/llama_cpp_python-*.tar.gz)
  fi
  tar -xzf "$sdist" -C "$tmp" --wildcards '*/vendor/llama.cpp/*' '*/CHANGELOG.md'
  local top S D
  top=$(ls -d "$tmp"/llama_cpp_python-*/)
  S=$top/vendor/llama.cpp
  D=$tmp/pack/llama.cpp
  mkdir -p "$D/ggml/src" "$D/vendor" "$D/tools" "$D/examples" "$D/pocs" "$D/cmake"
  # the library, common, ggml with its CPU and CUDA backends; no models/, docs/, tests/, benches/, app/
  cp -a "$S"/{CMakeLists.txt,LICENSE,include,src,common,licenses} "$D/"
  cp -a "$S"/cmake/{build-info,common,git-vars,license}.cmake "$S"/cmake/{llama-config.cmake.in,llama.pc.in} "$D/cmake/"
  cp -a "$S"/ggml/{CMakeLists.txt,cmake,include} "$D/ggml/"
  find "$S/ggml/src" -maxdepth 1 -type f -exec cp -a {} "$D/ggml/src/" \;
  cp -a "$S/ggml/src/ggml-cpu" "$S/ggml/src/ggml-cuda" "$D/ggml/src/"
  rm -rf "$D/ggml/src/ggml-cpu/"{spacemit,kleidiai} "$D/ggml/src/ggml-cpu/arch/"{arm,loongarch,powerpc,riscv,s390,wasm}
  cp -a "$S"/vendor/{CMakeLists.txt,nlohmann,sheredom,cpp-httplib} "$D/vendor/"
  cp -a "$S/tools/llama-bench" "$S/tools/completion" "$D/tools/"
  cp -a "$S/examples/speculative-simple" "$D/examples/"
  printf '%s\n' "# stripped for specjax experiments/gpu/llamacpp.sh" "find_package(Threads REQUIRED)" \
    "llama_add_compile_flags()" "add_subdirectory(llama-bench)" "add_subdirectory(completion)" > "$D/tools/CMakeLists.txt"
  printf '%s\n' "# stripped for specjax experiments/gpu/llamacpp.sh" "find_package(Threads REQUIRED)" \
    "llama_add_compile_flags()" "add_subdirectory(speculative-simple)" > "$D/examples/CMakeLists.txt"
  printf '%s\n' "# stripped for specjax experiments/gpu/llamacpp.sh: no proofs of concept" > "$D/pocs/CMakeLists.txt"
  printf '%s\n' "# stripped for specjax experiments/gpu/llamacpp.sh (hash, miniaudio, stb: mtmd only)" \
    "add_subdirectory(nlohmann)" "add_subdirectory(sheredom)" "if (LLAMA_BUILD_COMMON)" \
    "    add_subdirectory(cpp-httplib)" "endif()" > "$D/vendor/CMakeLists.txt"
  local v ggml commit
  v=$(sed -n 's/^set(LLAMA_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))/\2/p' "$S/CMakeLists.txt" | paste -sd.)
  ggml=$(sed -n 's/^set(GGML_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))/\2/p' "$S/ggml/CMakeLists.txt" | paste -sd.)
  commit=$(grep -m1 -o 'llama\.cpp@[0-9a-f]*' "$top/CHANGELOG.md" | cut -d@ -f2)
  cat > "$D/SPECJAX_SOURCE.txt" <<EOF
# llama.cpp as vendored in the PyPI sdist $(basename "$sdist") (vendor/llama.cpp; commit from the
# sdist's CHANGELOG), stripped by specjax experiments/gpu/llamacpp.sh --pack: no models/, docs/,
# tests/, benches/, app/, tools/ui or other tools, no non-CUDA ggml backends or non-x86 CPU code;
# tools/, examples/, pocs/ and vendor/ CMakeLists reduced to llama-bench, llama-completion and
# llama-speculative-simple.
sdist=$(basename "$sdist")
llama_cpp_commit=$commit
llama_cpp_version=$v
ggml_version=$ggml
EOF
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=2026-01-01 -C "$tmp/pack" -cf - llama.cpp \
    | gzip -9n > "$CARRY/llama.cpp.tar.gz"
  local gguf m name
  gguf=$("$py" -c "from specjax.io.fetch import fetch; print(fetch('$MODEL'))" | tail -1)
  "$py" experiments/llamacpp_side_by_side.py prompts --gguf "$gguf" --out "$CARRY/prompts.jsonl"
  [ -f "$CARRY"/whl/gguf-0.19.0-*.whl ] || "$py" -m pip download -q --no-deps --only-binary=:all: gguf==0.19.0 -d "$CARRY/whl"
  for m in $MODEL ${DRAFT_MODEL:-}; do
    if [ "$m" = smollm2-135m-instruct ]; then name=smol; else name=$m; fi
    gguf=$("$py" -c "from specjax.io.fetch import fetch; print(fetch('$m'))" | tail -1)
    ls "$CARRY/weights/$name".part* >/dev/null 2>&1 || split -b "${CHUNK_SIZE:-47M}" -d "$gguf" "$CARRY/weights/$name.part"
  done
  ls -la "$CARRY" "$CARRY/whl" "$CARRY/weights"
  echo "llama.cpp $v (commit $commit, ggml $ggml): $(du -b "$CARRY/llama.cpp.tar.gz" | cut -f1) bytes"
}
if [ "${1:-}" = --pack ]; then pack "${2:-}"; exit 0; fi

# --- the GPU machine -------------------------------------------------------------------------------
export WHEELS=${WHEELS:-$CARRY/whl} CHUNKS=${CHUNKS:-$CARRY/weights/*.part*}
source "$HERE/bootstrap.sh"
TAR=${LLAMA_TAR:-$CARRY/llama.cpp.tar.gz}
LLAMA_HOME=${LLAMA_HOME:-$HOME/llamacpp}
SRC=$LLAMA_HOME/llama.cpp BUILD=$LLAMA_HOME/build
STATE=$WORK/llamacpp
mkdir -p "$LLAMA_HOME" "$STATE"
built() { for t in $TARGETS; do [ -x "$BUILD/bin/$t" ] || return 1; done; }

# unpack (again when the tarball changed)
if [ -f "$TAR" ]; then
  sha=$(sha256sum "$TAR" | cut -c1-64)
  if [ "$(cat "$LLAMA_HOME/.tar.sha256" 2>/dev/null)" != "$sha" ]; then
    rm -rf "$SRC" "$BUILD"
    tar -xzf "$TAR" -C "$LLAMA_HOME"
    echo "$sha" > "$LLAMA_HOME/.tar.sha256"
    rm -f "$STATE/build.json"
  fi
elif [ ! -d "$SRC" ]; then
  echo "[llamacpp] no $TAR here and no source in $SRC: carry $TAR"; exit 1
fi
echo "[llamacpp] $(grep -v '^#' "$SRC/SPECJAX_SOURCE.txt" | tr '\n' ' ')"

# build (CUDA, Hopper), only what is missing; an interrupted build continues in the next call
if ! built; then
  commit=$(sed -n 's/^llama_cpp_commit=//p' "$SRC/SPECJAX_SOURCE.txt")
  CONFIGURE=(cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON
             -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
             -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_MTMD=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
             "-DLLAMA_BUILD_COMMIT=$commit")
  COMPILE=(cmake --build "$BUILD" -j "${JOBS:-16}" --target $TARGETS)
  tb=$(date +%s)
  set +e
  if [ ! -f "$BUILD/build.ninja" ]; then "${CONFIGURE[@]}" > "$STATE/build.log" 2>&1 || { cat "$STATE/build.log"; exit 1; }; fi
  if [ "${DETACH_BUILD:-0}" = 1 ]; then
    # the build runs on in its own process session while the machine stays warm (weight chunks
    # arriving in later calls); a later call finds the binaries, or waits for this pid below
    if ! kill -0 "$(cat "$STATE/build.pid" 2>/dev/null)" 2>/dev/null; then
      setsid nohup bash -c "$(printf '%q ' "${COMPILE[@]}") >> '$STATE/build.log' 2>&1; echo \$? > '$STATE/build.rc'" \
        > /dev/null 2>&1 < /dev/null &
      echo $! > "$STATE/build.pid"; echo "$tb" > "$STATE/build.t0"
      echo "[llamacpp] building $TARGETS in the background (pid $(cat "$STATE/build.pid"))"
    fi
    exit 0
  fi
  if kill -0 "$(cat "$STATE/build.pid" 2>/dev/null)" 2>/dev/null; then     # a detached build still running
    echo "[llamacpp] waiting for the background build"
    while kill -0 "$(cat "$STATE/build.pid")" 2>/dev/null && [ "$(left)" -gt 60 ]; do sleep 2; done
    tb=$(cat "$STATE/build.t0" 2>/dev/null || echo "$tb")
  fi
  limit=$(( $(left) - 20 ))
  if [ "$limit" -lt 30 ]; then echo "[llamacpp] no time left to build in this call: call again"; exit 0; fi
  echo "[llamacpp] building $TARGETS (at most $limit s of this call)"
  timeout "$limit" "${COMPILE[@]}" >> "$STATE/build.log" 2>&1
  rc=$?
  set -e
  prev=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('seconds', 0))" "$STATE/build.json" 2>/dev/null || echo 0)
  python3 - "$STATE/build.json" "$(( $(date +%s) - tb + ${prev%.*} ))" "$rc" "${CONFIGURE[*]}" "${COMPILE[*]}" <<'EOF'
import json, sys
path, seconds, rc, configure, compile_ = sys.argv[1:]
json.dump({"configure": configure, "build": compile_, "seconds": int(seconds), "last_exit": int(rc),
           "note": "seconds: build time summed over the calls it took"}, open(path, "w"), indent=1)
EOF
  tail -c 200000 "$STATE/build.log" > "$OUT/llamacpp_build.log"
  if ! built; then
    if [ "$rc" = 124 ]; then
      echo "[llamacpp] build stopped by this call's time limit after $(( $(date +%s) - tb )) s: call again (it continues)"
    else
      echo "[llamacpp] build failed (exit $rc): see llamacpp_build.log"
    fi
    tail -20 "$STATE/build.log"; exit 0
  fi
  echo "[llamacpp] built in $(( $(date +%s) - tb )) s"
fi

GGUF=$(python3 -c "from specjax.io.fetch import model_path; print(model_path('$MODEL'))")
DRAFT_ARGS=()
if [ -n "${DRAFT_MODEL:-}" ]; then
  DRAFT_GGUF=$(python3 -c "from specjax.io.fetch import model_path; print(model_path('$DRAFT_MODEL'))")
  [ -f "$DRAFT_GGUF" ] || { echo "[llamacpp] $DRAFT_MODEL is not installed yet (chunks: $(ls "$WORK/chunks" | tr '\n' ' '))"; exit 0; }
  DRAFT_ARGS=(--draft-gguf "$DRAFT_GGUF")
fi
if [ ! -f "$GGUF" ]; then
  echo "[llamacpp] llama.cpp is built; $MODEL is not installed yet (chunks so far: $(ls "$WORK/chunks" | tr '\n' ' ')):"
  echo "[llamacpp] call again at once carrying the other chunk"; exit 0
fi
PROMPTS=${PROMPTS:-$CARRY/prompts.jsonl}
[ -f "$PROMPTS" ] || { echo "[llamacpp] no $PROMPTS: carry it"; exit 1; }
limit=$(( $(left) - 5 ))
if [ "$limit" -lt 60 ]; then echo "[llamacpp] built and installed, but only $limit s left: call again"; exit 0; fi
echo "[llamacpp] running both sides on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $limit s left"
set +e
timeout "$limit" python3 experiments/llamacpp_side_by_side.py run --bin "$BUILD/bin" --src "$SRC" \
  --gguf "$GGUF" "${DRAFT_ARGS[@]}" --prompts "$PROMPTS" --state "$STATE" --out "$OUT" --deadline-s $(( $(left) - 15 )) \
  --max-new "${MAX_NEW:-256}" --dtype "${DTYPE:-bfloat16}" ${EXTRA:-}
echo "[llamacpp] side by side: exit $? after $(( $(date +%s) - T0 )) s in all"
ls -la "$OUT"
