#!/usr/bin/env bash
# Builds dta on a GPU machine (Ubuntu, torch in /opt/torch/.venv, no Abseil or simdjson
# packages): uses the libraries unpacked into .deps/ by scripts/device_deps.sh. Arguments go to
# CMake's configure step; DTA_DEVICE_TARGETS (space-separated) builds only those targets and what
# they need, instead of everything. DTA_DEVICE_SERVICES=1 makes the gRPC services buildable (pass
# -DDTA_BUILD_SERVICES=ON): the Debian packages device_deps.sh keeps in .deps/services-debs are
# unpacked once into build-device/services-root, their PATH and libraries put first.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python="${DTA_PYTHON:-$(command -v python3)}"
export LD_LIBRARY_PATH="$repo/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
prefix="$repo/.deps/usr;$repo/.deps/usr/lib/x86_64-linux-gnu/cmake"
link=()
if [[ "${DTA_DEVICE_SERVICES:-0}" == 1 ]]; then
  root="$(scripts/device_services_root.sh "$repo/.deps/services-debs" "$repo/build-device/services-root")"
  export PATH="$root/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH"
  prefix="$root/usr;$root/usr/lib/x86_64-linux-gnu/cmake;$prefix"
  # RE2 comes through pkg-config, whose re2.pc names -L/usr/lib/x86_64-linux-gnu (the packages'
  # own prefix), not the unpacked root.
  link=("-DCMAKE_EXE_LINKER_FLAGS=-L$root/usr/lib/x86_64-linux-gnu"
    "-DCMAKE_SHARED_LINKER_FLAGS=-L$root/usr/lib/x86_64-linux-gnu")
fi
cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DDTA_PYTHON="$python" -DDTA_BUILD_BENCH=OFF "${link[@]}" "$@"
# -k 0: one failing target (the gRPC Python stubs, where grpc_tools is missing) must not stop the rest.
targets=()
for t in ${DTA_DEVICE_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build build-device -j"$(nproc)" "${targets[@]}" -- -k 0
