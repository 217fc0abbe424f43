#!/usr/bin/env bash
# Configures (once) and builds dta into build/ with Ninja and ccache, then installs the Python
# package dta (pyproject.toml: trajectories, the executor's extension, the dispatcher's client and
# stubs) into .venv when its inputs changed.
#
# build/ is also the package's build directory, so the C++ is compiled once: build/ is configured
# with the extension on (DTA_BUILD_PYTHON, position-independent code) and pip, through
# scikit-build-core, only reconfigures it with the same options, finds the extension up to date and
# installs it. Release by default (-O3, no debug info): the tests run on optimized code, and debug
# info for LibTorch's headers doubles a translation unit's compile time. Extra arguments go to a
# fresh configure, e.g. `rm -rf build && scripts/build.sh -DCMAKE_BUILD_TYPE=RelWithDebInfo`.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python="$repo/.venv/bin/python"

cache_value() { sed -n "s/^$1:[A-Z]*=//p" build/CMakeCache.txt; }

# A build/ from before the extension was built in it is reconfigured once, keeping its options.
if [[ ! -f build/build.ninja || "$(cache_value DTA_BUILD_PYTHON)" != "ON" ]]; then
  build_type="Release"
  if [[ -f build/CMakeCache.txt ]]; then build_type="$(cache_value CMAKE_BUILD_TYPE)"; fi
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="$build_type" -DDTA_BUILD_PYTHON=ON \
    -DDTA_PYTHON="$python" -DPython3_EXECUTABLE="$python" "$@"
fi
cmake --build build -j"$(nproc)"

# The stamp in the venv (the hash of every input) skips pip altogether when nothing changed.
stamp="$repo/.venv/.dta-package.sha256"
inputs="$(find pyproject.toml CMakeLists.txt cmake bindings core executor kernels proto dispatcher/batch scripts/requirements.txt scripts/requirements-headers.txt scripts/build.sh \
            -type f -not -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$inputs" ]]; then
  echo "build: installing the Python package dta into .venv (from build/)"
  # pyproject.toml's own settings build a package-only tree in build/python; these point
  # scikit-build-core at build/ instead, with build/'s build type and options, so its configure
  # changes nothing that would recompile.
  settings=(-C build-dir=build -C "cmake.build-type=$(cache_value CMAKE_BUILD_TYPE)")
  for option in DTA_BUILD_TESTS DTA_BUILD_BENCH DTA_BUILD_TOOLS DTA_BUILD_SERVICES DTA_BUILD_FUZZERS \
                DTA_BUILD_TORCH DTA_BUILD_CUDA; do
    settings+=(-C "cmake.define.$option=$(cache_value "$option")")
  done
  CMAKE_GENERATOR=Ninja CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$python" -m pip install -q --no-build-isolation --no-deps "${settings[@]}" .
  echo "$inputs" >"$stamp"
fi
