#!/usr/bin/env bash
# Configures (once) and builds dta into build/ with Ninja and ccache.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
if [[ ! -f build/build.ninja ]]; then
  cmake -S . -B build -G Ninja -DDTA_PYTHON="$repo/.venv/bin/python" "$@"
fi
cmake --build build -j"$(nproc)"
