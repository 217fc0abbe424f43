#!/usr/bin/env bash
# The Python package on a GPU machine, without pip (the machines have neither scikit-build-core nor
# grpcio-tools): builds the extension dta._core with CMake in build-device-python/ and assembles the
# package from bindings/python/dta and the built module in build-device-python/site, which goes on
# PYTHONPATH. Needs .deps/ carried (scripts/device_deps.sh). Used by scripts/gpu_python.sh and
# scripts/gpu_hf_baseline.sh; prints the site directory.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python="${DTA_PYTHON:-$(command -v python3)}"
export LD_LIBRARY_PATH="$repo/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
build=build-device-python
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$repo/.deps/usr;$repo/.deps/usr/lib/x86_64-linux-gnu/cmake" -DDTA_PYTHON="$python" \
  -DDTA_BUILD_PYTHON=ON -DDTA_BUILD_TOOLS=OFF -DDTA_BUILD_TESTS=OFF -DDTA_BUILD_BENCH=OFF \
  -DDTA_BUILD_SERVICES=OFF >"$build.configure.log" 2>&1 || { tail -30 "$build.configure.log" >&2; exit 1; }
cmake --build "$build" --target dta_python -j"$(nproc)" >"$build.log" 2>&1 || { tail -40 "$build.log" >&2; exit 1; }
site="$build/site"
rm -rf "$site" && mkdir -p "$site"
cp -r bindings/python/dta "$site/dta"
cp "$build"/python/dta/_core*.so "$site/dta/"
echo "$repo/$site"
