#!/usr/bin/env bash
# Builds dta on a GPU machine (Ubuntu, torch in /opt/torch/.venv, no Abseil or simdjson
# packages): uses the libraries unpacked into .deps/ by scripts/device_deps.sh. Arguments go to
# CMake's configure step; DTA_DEVICE_TARGETS (space-separated) builds only those targets and what
# they need, instead of everything.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python="${DTA_PYTHON:-$(command -v python3)}"
export LD_LIBRARY_PATH="$repo/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$repo/.deps/usr;$repo/.deps/usr/lib/x86_64-linux-gnu/cmake" \
  -DDTA_PYTHON="$python" -DDTA_BUILD_BENCH=OFF "$@"
# -k 0: one failing target (the gRPC Python stubs, where grpc_tools is missing) must not stop the rest.
targets=()
for t in ${DTA_DEVICE_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build build-device -j"$(nproc)" "${targets[@]}" -- -k 0
