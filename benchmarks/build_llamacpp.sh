#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-server and llama-quantize (CPU only,
# native flags) from the sources that the PyPI `llama-cpp-python` sdist
# carries (vendor/llama.cpp), once, into a cache folder.  Used by
# benchmarks/vs_llamacpp.py, which builds nothing itself.
#
# Usage:
#   benchmarks/build_llamacpp.sh                 # version 0.3.36, default cache
#   LLAMACPP_PY_VERSION=0.3.36 LLAMACPP_DIR=/some/dir benchmarks/build_llamacpp.sh
#   JOBS=2 NICE=10 benchmarks/build_llamacpp.sh
#   LLAMACPP_KEEP_AMX=1 benchmarks/build_llamacpp.sh   # keep the AMX path on an AMX CPU
#   LLAMACPP_ISA=avx2 benchmarks/build_llamacpp.sh  # AVX2 + FMA + F16C, no AVX-512
#                                      (GGML_NATIVE=OFF), into its own folder (…-avx2)
#   benchmarks/build_llamacpp.sh --print-stamp  # what a finished build records, then exit
#
# Network: only the package registry pip is configured with (`pip download`
# of the sdist).  The build turns off everything that would fetch at build
# time (the server's prebuilt web UI, npm, OpenSSL/HTTPS model download).
#
# Idempotent: when "$LLAMACPP_DIR/bin" already holds the three binaries and
# the stamp file names the same version and flags, it prints the folder and
# exits without doing anything.  Prints the bin folder on its last line.
set -euo pipefail

VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"
ISA="${LLAMACPP_ISA:-native}"
CACHE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/radixserve"
if [[ "$ISA" == native ]]; then
    DEST="${LLAMACPP_DIR:-$CACHE_ROOT/llamacpp-$VERSION}"
else
    DEST="${LLAMACPP_DIR:-$CACHE_ROOT/llamacpp-$VERSION-$ISA}"
fi
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"
PYTHON="${PYTHON:-python3}"
BINARIES=(llama-bench llama-server llama-quantize)
case "$ISA" in
    native) ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
    # ggml's own switches for an AVX2 build (what its x86 "haswell" variant enables)
    avx2) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                     -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF
                     -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF
                     -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    *) echo "LLAMACPP_ISA=$ISA: native or avx2" >&2; exit 2 ;;
esac
CMAKE_FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    "${ISA_FLAGS[@]}"
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF
    -DBUILD_SHARED_LIBS=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_OPENSSL=OFF
)
# On a CPU with AMX, -march=native also compiles llama.cpp's AMX path, and that path of this
# version segfaults at the first matmul (ggml_backend_amx_mul_mat; seen on a 2-core Xeon VM).
# Compiled without AMX, llama.cpp runs its AVX-512 kernels with repacked weights: what it
# runs on every CPU without AMX. (GCC keeps explicit -mno-* over what -march implies.)
if [[ "$ISA" == native ]] && grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && [[ -z "${LLAMACPP_KEEP_AMX:-}" ]]; then
    CMAKE_FLAGS+=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                  "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
STAMP="llama-cpp-python==$VERSION ${CMAKE_FLAGS[*]}"
if [[ "${1:-}" == "--print-stamp" ]]; then
    echo "$STAMP"
    exit 0
fi

have_all() {
    local b
    for b in "${BINARIES[@]}"; do
        [[ -x "$DEST/bin/$b" ]] || return 1
    done
    [[ -f "$DEST/STAMP" && "$(cat "$DEST/STAMP")" == "$STAMP" ]]
}

if have_all; then
    echo "llama.cpp ($VERSION) already built"
    echo "$DEST/bin"
    exit 0
fi

command -v cmake >/dev/null || {
    echo "cmake not found: install it (apt-get install -y cmake, or pip install cmake)" >&2
    exit 1
}

mkdir -p "$DEST"
WORK="$(mktemp -d "$DEST/work.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

echo "downloading llama-cpp-python==$VERSION sdist (package registry only)" >&2
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$WORK/sdist"
SDIST="$(ls "$WORK"/sdist/llama_cpp_python-*.tar.gz | head -n 1)"
tar -xzf "$SDIST" -C "$WORK"
SRC="$(ls -d "$WORK"/llama_cpp_python-*/vendor/llama.cpp)"

echo "building in $WORK/build with -j$JOBS (nice $NICE)" >&2
nice -n "$NICE" cmake -S "$SRC" -B "$WORK/build" -G "Unix Makefiles" "${CMAKE_FLAGS[@]}" >&2
nice -n "$NICE" cmake --build "$WORK/build" --config Release -j "$JOBS" \
    --target "${BINARIES[@]}" >&2

mkdir -p "$DEST/bin"
for b in "${BINARIES[@]}"; do
    install -m 0755 "$WORK/build/bin/$b" "$DEST/bin/$b"
done
# the compiler and the CPU flags the binaries were built with, for the record
grep -E '^(CMAKE_C_COMPILER|GGML_NATIVE|CMAKE_BUILD_TYPE):' "$WORK/build/CMakeCache.txt" \
    >"$DEST/BUILD_INFO" || true
echo "$STAMP" >"$DEST/STAMP"
echo "llama.cpp ($VERSION) built" >&2
echo "$DEST/bin"
