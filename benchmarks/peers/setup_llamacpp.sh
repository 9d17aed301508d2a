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
cmake -S src/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > cmake.log
cmake --build build --target llama-server -j "$(nproc)" > build.log
echo "llama-server built in $((SECONDS - t0)) s: $PEERS/llamacpp/build/bin/llama-server"
