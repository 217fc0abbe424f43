#!/usr/bin/env bash
# Builds the dispatcher (its write-ahead log, core, service, client and binaries) with clang and
# -Wthread-safety -Werror=thread-safety, so that its ABSL_GUARDED_BY / ABSL_EXCLUSIVE_LOCKS_REQUIRED
# annotations are checked (GCC ignores them). No LibTorch: configures in build-tsa/ in seconds and
# compiles only the dispatcher's targets. Run by scripts/test.sh.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
build="${DTA_TSA_BUILD_DIR:-$repo/build-tsa}"
if [[ ! -f "$build/build.ninja" ]]; then
  mkdir -p "$build"
  cmake -S . -B "$build" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_CXX_FLAGS="-Wthread-safety -Wthread-safety-beta -Werror=thread-safety -Werror=thread-safety-beta" \
    -DDTA_BUILD_TORCH=OFF -DDTA_BUILD_CUDA=OFF -DDTA_BUILD_TESTS=OFF -DDTA_BUILD_BENCH=OFF \
    -DDTA_PYTHON="$repo/.venv/bin/python" >"$build/configure.log" 2>&1 || { tail -30 "$build/configure.log"; exit 1; }
fi
echo "thread_safety: clang -Wthread-safety over the dispatcher (build-tsa/)"
cmake --build "$build" -j"$(nproc)" --target dta_wal dta_dispatcher_core dta_dispatcher_service \
  dta_dispatcher_client dta-dispatcher dta-send
