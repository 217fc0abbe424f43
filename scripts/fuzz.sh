#!/usr/bin/env bash
# Fuzzes trajectory validation and tree building (tests/fuzz/trajectory_fuzzer.cc) with libFuzzer,
# ASan and UBSan for the given seconds (default 20; 0 only replays the corpus).
#
#   scripts/fuzz.sh          # the short run of the test command
#   scripts/fuzz.sh 3600     # a longer run, on demand
#
# libFuzzer is clang's, and the whole project must be compiled by one compiler, so the fuzzer is
# built in build-asan/, the clang build that scripts/sanitizers.sh runs the tests in
# (scripts/clang_checks_build.sh: every unit instrumented for coverage and the sanitizers); after
# the sanitizers' run it is already built. Alone, only the fuzzer and what it links are built. The
# corpus, build-asan/fuzz/corpus, starts from the seeds the fuzzer writes and keeps what every run
# adds. Exits non-zero, naming the input, if
# libFuzzer finds a crash, a sanitizer error, a leak, a timeout or an out-of-memory.
#
# The mutations follow a fixed seed (DTA_FUZZ_SEED, default 1; 0 draws one at random), so a fresh
# clone's short run (CI's) explores the same inputs on every machine, only more of them on a
# faster one, and whatever it finds is found again here.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-20}"
if [[ ! "$seconds" =~ ^[0-9]+$ ]]; then
  echo "usage: scripts/fuzz.sh [seconds]   (default 20; 0 replays the corpus only)" >&2
  exit 2
fi
source "$repo/scripts/clang_checks_build.sh"
build="$checks_build"
work="$build/fuzz"
fuzzer="$build/bin/trajectory_fuzzer"

for tool in clang clang++ cmake ninja; do
  if ! command -v "$tool" >/dev/null; then
    echo "fuzz: $tool not found (scripts/setup.sh installs clang and libclang-rt-14-dev)" >&2
    exit 1
  fi
done

configure_checks_build
# The target list is read whole before grep looks at it: `ninja ... | grep -q` under pipefail fails
# whenever grep stops reading at its first match while ninja still writes (SIGPIPE).
targets="$(ninja -C "$build" -t targets all)"
if ! grep -q '^trajectory_fuzzer:' <<<"$targets"; then
  echo "fuzz: $build has no trajectory_fuzzer target: is tests/fuzz added in tests/CMakeLists.txt" \
       "(with DTA_BUILD_FUZZERS and gRPC found)?" >&2
  exit 1
fi
cmake --build "$build" --target trajectory_fuzzer

rm -rf "$work/seeds"
mkdir -p "$work/seeds" "$work/corpus" "$work/crashes"
"$fuzzer" --write-seeds="$work/seeds" >/dev/null
cp "$work/seeds"/* "$work/corpus"/

log="$work/last-run.log"
args=(-seed="${DTA_FUZZ_SEED:-1}" -rss_limit_mb=2048 -timeout=10 -max_len=16384 -print_final_stats=1
      -dict="$repo/tests/fuzz/trajectory_fuzzer.dict" -artifact_prefix="$work/crashes/")
if ((seconds > 0)); then
  args+=(-max_total_time="$seconds")
  echo "fuzz: running trajectory_fuzzer for $seconds s on $work/corpus (log: $log)"
else
  args+=(-runs=0)
  echo "fuzz: replaying $work/corpus (log: $log)"
fi
status=0
"$fuzzer" "${args[@]}" "$work/corpus" >"$log" 2>&1 || status=$?

final_stat() { sed -n "s/^stat::$1: *//p" "$log" | tail -n 1; }
last="$(grep -E '^#[0-9]+.*cov: ' "$log" | tail -n 1 || true)"
cov="$(sed -n 's/.*cov: \([0-9]*\).*/\1/p' <<<"$last")"
ft="$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")"
corp="$(sed -n 's/.* corp: \([0-9]*\).*/\1/p' <<<"$last")"
if ((status != 0)); then
  crash="$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)"
  tail -n 60 "$log" >&2
  echo "fuzz: FAILED (libFuzzer exit status $status) after $(final_stat number_of_executed_units) inputs" >&2
  if [[ -n "$crash" ]]; then
    echo "fuzz: the input: $crash" >&2
    echo "fuzz: reproduce: $fuzzer $crash" >&2
  fi
  echo "fuzz: full log: $log" >&2
  exit 1
fi
echo "fuzz: OK, no crash: $(final_stat number_of_executed_units) inputs in $seconds s" \
     "($(final_stat average_exec_per_sec)/s); coverage ${cov:-?} edges, ${ft:-?} features;" \
     "corpus ${corp:-?} inputs; peak RSS $(final_stat peak_rss_mb) MB"
