#!/usr/bin/env bash
# Build llama.cpp's native `llama-server` from the sources vendored in the llama-cpp-python sdist
# (native CPU flags). About 6-7 minutes on 2 cores. Result: .peers/llamacpp/build/bin/llama-server
source "$(dirname "$0")/common.sh"
t0=$SECONDS
cd "$PEERS"
mkdir -p llamacpp && cd llamacpp
if [ ! -d src ]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d sdist
  mkdir -p src && tar -xzf sdist/llama_cpp_python-0.3.36.tar.gz -C src --strip-components=1
fi
# NOTE: not GGML_NATIVE: these VMs report AMX in /proc/cpuinfo but the kernel does not grant
# it, and ggml's AMX path dies with "Illegal instruction". Name the AVX-512 features instead.
cmake -S src/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON \
  -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > cmake.log
cmake --build build --target llama-server -j "$(nproc)" > build.log
echo "llama-server built in $((SECONDS - t0)) s: $PEERS/llamacpp/build/bin/llama-server"
