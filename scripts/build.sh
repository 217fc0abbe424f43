#!/usr/bin/env bash
# Configures (once) and builds dta into build/ with Ninja and ccache, then installs the Python
# package dta (pyproject.toml: trajectories, the executor's extension, the dispatcher's client and
# stubs) into .venv when its inputs changed.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
if [[ ! -f build/build.ninja ]]; then
  cmake -S . -B build -G Ninja -DDTA_PYTHON="$repo/.venv/bin/python" "$@"
fi
cmake --build build -j"$(nproc)"

# The package builds in build/python (pyproject.toml), so a rebuild recompiles only what changed;
# the stamp in the venv (the hash of every input) skips pip altogether when nothing did.
stamp="$repo/.venv/.dta-package.sha256"
inputs="$(find pyproject.toml CMakeLists.txt cmake bindings core executor kernels proto dispatcher/batch scripts/requirements.txt scripts/requirements-headers.txt \
            -type f -not -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$inputs" ]]; then
  echo "build: installing the Python package dta into .venv (build/python)"
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" .venv/bin/python -m pip install -q --no-build-isolation --no-deps .
  echo "$inputs" >"$stamp"
fi
