#!/usr/bin/env bash
# Runs every test: installs what is missing, builds, then CTest (GoogleTest suites, the layering and
# formatting checks), clang's -Wthread-safety over the dispatcher (scripts/thread_safety.sh, in
# build-tsa/), a short fuzzing run (scripts/fuzz.sh, clang's libFuzzer, in build-fuzz/) and pytest
# (tests/python: parity with Hugging Face transformers, using the binaries in build/).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh"
"$repo/scripts/build.sh"
cd "$repo"
ctest --test-dir build --output-on-failure -j"$(nproc)"
"$repo/scripts/thread_safety.sh"
# A short libFuzzer run on trajectory validation and tree building (scripts/fuzz.sh 3600 for more).
"$repo/scripts/fuzz.sh" 20
DTA_BUILD_DIR="$repo/build" "$repo/.venv/bin/python" -m pytest -q "$repo/tests/python"
