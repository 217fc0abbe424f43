#!/usr/bin/env bash
# Runs every test: installs what is missing, builds, then CTest (GoogleTest suites, the layering and
# formatting checks), the torch-free tests again under ASan, LSan and UBSan in one clang build that
# also checks the dispatcher's locking with -Wthread-safety (scripts/sanitizers.sh, in build-asan/),
# a short fuzzing run of that build's libFuzzer target (scripts/fuzz.sh) and pytest (tests/python:
# parity with Hugging Face transformers, using the binaries in build/).
# Each step prints how long it took, so a slow CI run shows where its time went.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

step() {
  local name="$1" start=$SECONDS
  shift
  "$@"
  echo "test.sh: $name took $((SECONDS - start)) s (total $SECONDS s)"
}

step setup "$repo/scripts/setup.sh"
step build "$repo/scripts/build.sh"
# One thread per test: CTest runs nproc tests at once, and LibTorch's OpenMP pool of nproc threads in
# each (spinning while it waits) made the float64 equivalence tests 4-5x slower than alone.
step ctest env OMP_NUM_THREADS=1 ctest --test-dir build --output-on-failure -j"$(nproc)"
step sanitizers "$repo/scripts/sanitizers.sh"
# A short libFuzzer run on trajectory validation and tree building (scripts/fuzz.sh 3600 for more).
step fuzz "$repo/scripts/fuzz.sh" 20
# pytest-xdist: the files spread over every core, each file's tests in one worker (--dist loadfile:
# a module's fixtures, a model or a checkpoint, are built once), one LibTorch thread per worker.
step pytest env DTA_BUILD_DIR="$repo/build" OMP_NUM_THREADS=1 "$repo/.venv/bin/python" -m pytest -q \
  -n "$(nproc)" --dist loadfile --durations=10 "$repo/tests/python"
