#!/usr/bin/env bash
# Builds the torch-free tests (core/, dispatcher/, apps/ and apps/metrics, with the binaries they
# start: dta-dispatcher, dta-tree, ...) with AddressSanitizer (LeakSanitizer included) and
# UndefinedBehaviorSanitizer, and runs them under CTest. Exits non-zero on a failing test or on any
# sanitizer report, a child process's included (a test does not always check how a binary it
# started exited). Run by scripts/test.sh.
#
#   scripts/sanitizers.sh            # build what changed, then run every test
#   scripts/sanitizers.sh -R Wal     # extra arguments go to CTest
#
# Everything is built in build-asan/ (scripts/clang_checks_build.sh: clang, -O1, line tables, also
# instrumented for libFuzzer and checked with -Wthread-safety, so that scripts/fuzz.sh reuses it);
# Ninja and ccache make a rebuild a no-op when nothing changed. No LibTorch, no CUDA: the
# executor's and the kernels' tests run only in build/ (and scripts/gpu_test.sh runs the kernels
# under compute-sanitizer). Reports go to build-asan/sanitizers/report.<pid>; the script prints
# them and fails when there are any.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
source "$repo/scripts/clang_checks_build.sh"
configure_checks_build
build="$checks_build"
# Every target of this tree: with no LibTorch they are the torch-free libraries, tools and tests.
cmake --build "$build" -j"$(nproc)"

reports="$build/sanitizers"
rm -rf "$reports"
mkdir -p "$reports"
# detect_leaks: LeakSanitizer at every exit. abort_on_error / halt_on_error: the first report ends
# the process (a test that went on after one would pass). log_path: reports go to files (one
# runtime serves the three tools, so one prefix), and a report from a child process whose exit
# status its test ignores still fails this script. The other three find more: use of a returned
# function's locals, globals read before their initializer ran, str* reads past a missing NUL.
log="log_path=$reports/report"
asan="detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1"
asan+=":check_initialization_order=1:strict_string_checks=1"
export ASAN_OPTIONS="$asan:$log"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:$log"
export LSAN_OPTIONS="$log"
# The layering and formatting checks compile nothing and already run in build/'s CTest.
echo "sanitizers: running the tests under ASan, LSan and UBSan ($build)"
status=0
ctest --test-dir "$build" --output-on-failure -j"$(nproc)" --timeout 600 \
  -E '^(layering|layering_self|format|format_self)_test$' "$@" || status=$?

shopt -s nullglob
found=("$reports"/*)
if ((${#found[@]})); then
  for report in "${found[@]}"; do
    echo "sanitizers: ==== $report"
    head -n 80 "$report"
  done
  echo "sanitizers: FAILED: ${#found[@]} sanitizer report(s) in $reports" >&2
  exit 1
fi
if ((status != 0)); then
  echo "sanitizers: FAILED: CTest exit status $status (no sanitizer report)" >&2
  exit "$status"
fi
echo "sanitizers: OK, no sanitizer report"
