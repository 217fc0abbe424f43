#!/usr/bin/env bash
# Runs every test: installs what is missing, builds, then CTest (GoogleTest suites).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh"
"$repo/scripts/build.sh"
cd "$repo"
ctest --test-dir build --output-on-failure -j"$(nproc)"
