#!/usr/bin/env bash
# Build llama.cpp's native `llama-server` from the sources vendored in the llama-cpp-python sdist,
# for this host's ISA. About 6-7 minutes on 2 cores.
# Result: .peers/llamacpp/build-<level>/bin/llama-server, and beside it llama-server.isa.json
# (the ISA level, every cmake flag, the machine it was built on).
source "$(dirname "$0")/common.sh"
t0=$SECONDS
cd "$PEERS"
mkdir -p llamacpp && cd llamacpp
if [ ! -d src ]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d sdist
  mkdir -p src && tar -xzf sdist/llama_cpp_python-0.3.36.tar.gz -C src --strip-components=1
fi
# NOTE: not GGML_NATIVE (these VMs report AMX in /proc/cpuinfo but the kernel does not grant it:
# ggml's AMX path dies with "Illegal instruction"), and not a fixed AVX-512 list either (an
# AVX2-only Zen 3 dies the same way): llamacpp_isa.py names each feature the host lists, AMX off.
BUILD="$(llamacpp_isa build-dir)"  # keyed by ISA: another kind of machine builds its own
ISA_FLAGS_TEXT="$(llamacpp_isa cmake-flags)"
mapfile -t ISA_FLAGS <<< "$ISA_FLAGS_TEXT"
FLAGS=(-DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF)
echo "building llama-server for ${BUILD#build-}: ${ISA_FLAGS[*]}"
mkdir -p "$BUILD"
cmake -S src/vendor/llama.cpp -B "$BUILD" "${FLAGS[@]}" > "$BUILD/cmake.log"
cmake --build "$BUILD" --target llama-server -j "$(nproc)" > "$BUILD/build.log"
# Written only once the binary exists: run_comparison.sh copies it into the results folder.
llamacpp_isa record "$BUILD/bin" "${FLAGS[@]}" > /dev/null
echo "llama-server built in $((SECONDS - t0)) s: $PEERS/llamacpp/$BUILD/bin/llama-server (record: llama-server.isa.json beside it)"
