#!/usr/bin/env bash
# Sourced by scripts/sanitizers.sh and scripts/fuzz.sh: configures build-asan/ (DTA_ASAN_BUILD_DIR),
# the one build of the torch-free code that both run, so CI compiles it once for all three checks:
# - AddressSanitizer (LeakSanitizer included) and UndefinedBehaviorSanitizer over every unit;
# - libFuzzer's coverage instrumentation (-fsanitize=fuzzer-no-link) and the fuzzers
#   (DTA_BUILD_FUZZERS, tests/fuzz), whose own target links libFuzzer's main;
# - clang's -Wthread-safety as an error, so the dispatcher's ABSL_GUARDED_BY and
#   ABSL_EXCLUSIVE_LOCKS_REQUIRED annotations are checked (GCC ignores them).
# With clang (gcc when clang is missing: the sanitizers only), -O1 and line tables; assertions stay
# on (no -DNDEBUG). No LibTorch, no CUDA. Configured once, and again only when these arguments
# change (a stale cache would keep old flags); then Ninja and ccache make a rebuild a no-op.
# Sets `checks_build` (the directory) and `checks_clang` (1 with clang).
checks_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
checks_build="${DTA_ASAN_BUILD_DIR:-$checks_repo/build-asan}"

configure_checks_build() {
  local cc cxx debug flags warnings=""
  if command -v clang++ >/dev/null && command -v clang >/dev/null; then
    cc=clang cxx=clang++ debug=-gline-tables-only checks_clang=1
    flags="-fsanitize=fuzzer-no-link,address,undefined"
    warnings=" -Wthread-safety -Wthread-safety-beta -Werror=thread-safety -Werror=thread-safety-beta"
  else
    cc=gcc cxx=g++ debug=-g1 checks_clang=0
    flags="-fsanitize=address,undefined"
  fi
  # -fno-sanitize-recover: UBSan's first report ends the process (a libFuzzer crash, a failed test).
  flags+=" -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
  local configure=(-G Ninja -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx"
    -DCMAKE_BUILD_TYPE=RelWithDebInfo
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags$warnings"
    -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 $debug" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 $debug"
    -DDTA_BUILD_TORCH=OFF -DDTA_BUILD_CUDA=OFF -DDTA_BUILD_PYTHON=OFF -DDTA_BUILD_BENCH=OFF
    -DDTA_BUILD_FUZZERS="$([[ $checks_clang == 1 ]] && echo ON || echo OFF)"
    -DDTA_BUILD_TESTS=ON -DDTA_BUILD_TOOLS=ON
    -DDTA_PYTHON="$checks_repo/.venv/bin/python")
  local stamp="$checks_build/checks.configure"
  if [[ ! -f "$checks_build/build.ninja" || ! -f "$stamp" || "$(cat "$stamp")" != "${configure[*]}" ]]; then
    echo "checks build: configuring $checks_build ($cxx, $flags$warnings)"
    rm -f "$checks_build/CMakeCache.txt"
    mkdir -p "$checks_build"
    cmake -S "$checks_repo" -B "$checks_build" "${configure[@]}" >"$checks_build/configure.log" 2>&1 ||
      { tail -30 "$checks_build/configure.log"; return 1; }
    echo "${configure[*]}" >"$stamp"
  fi
}
