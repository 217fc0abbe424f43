#!/usr/bin/env bash
# The GPU test run: builds on a GPU machine (scripts/device_build.sh, with .deps/ carried) and runs
# every test there, the GPU-only ones included: the tree-attention kernels against the float64
# reference and the fused layers' kernels against their ATen paths (tests/kernels), and the methods' equivalence on CUDA in float64, float32 and bfloat16
# (tests/executor/engine/gpu_equivalence_test.cc). Then compute-sanitizer over small cases of the
# kernel tests: memcheck (out-of-bounds and misaligned accesses, device-side faults) and racecheck
# (shared-memory hazards) on dta's own kernels. Logs go to ${OUT:-build-device}/gpu_test/.
#
#   scripts/gpu_test.sh [--no_build] [--no_sanitizers] [CTEST ARGS...]
#       e.g. scripts/gpu_test.sh -R GpuEquivalence
#
# Fails on a failing test or on any compute-sanitizer error or hazard. Without compute-sanitizer
# (the CUDA toolkit's bin/, or $COMPUTE_SANITIZER) the sanitizer runs are skipped, saying so.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
build=1 sanitizers=1
while (($#)); do
  case "$1" in
    --no_build) build=0 ;;
    --no_sanitizers) sanitizers=0 ;;
    *) break ;;
  esac
  shift
done
export LD_LIBRARY_PATH="$repo/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
logs="${OUT:-build-device}/gpu_test"
mkdir -p "$logs"
if ((build)); then
  start=$SECONDS
  scripts/device_build.sh >"$logs/build.log" 2>&1 || { tail -40 "$logs/build.log"; exit 1; }
  echo "gpu_test: built in $((SECONDS - start)) s"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# The GPU suites first, verbosely (their agreement tables are the record), then everything.
status=0
for t in tree_attention_test fused_layers_test chain_attention_test chunk_attention_test gpu_equivalence_test; do
  build-device/tests/$t >"$logs/$t.log" 2>&1 || status=1
  grep -E "^\[  |^(float|bfloat)|Failure" "$logs/$t.log" || true
done
ctest --test-dir build-device -j"$(nproc)" --output-on-failure "$@" >"$logs/ctest.log" 2>&1 || status=1
tail -15 "$logs/ctest.log"
((sanitizers)) || exit "$status"

# compute-sanitizer slows the kernels it checks 10-100x (racecheck most), so each suite runs its
# small cases only, and only dta's kernels are checked (--kernel-name: a substring of the mangled
# name, namespace dta::kernels); ATen's, cuBLAS' and cuDNN's run unchecked at full speed. About
# 15 s of memcheck and 2.5 minutes of racecheck on one H200.
sanitizer="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}"
if [[ -z "$sanitizer" && -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ]]; then
  sanitizer="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
fi
if [[ -z "$sanitizer" ]]; then
  echo "gpu_test: compute-sanitizer is neither on PATH nor in ${CUDA_HOME:-/usr/local/cuda}/bin" \
       "(set COMPUTE_SANITIZER to it): memcheck and racecheck SKIPPED" >&2
  exit "$status"
fi
"$sanitizer" --version | tail -1
# suite:filter, the filters naming tests of a few small shapes each.
cases=(
  "tree_attention_test:TreeAttentionCuda.SmallChunks:*.UnsupportedInputsFallBackToTheReference"
  "hopper_tree_attention_test:HopperTreeAttention.SmallChunks"
  "fused_layers_test:FusedLayersCuda.*"
  "chunk_attention_test:ChunkAttentionCuda.CudaMergeEqualsTheAtenMerge"
  "chunk_state_recurrence_test:Cases/ChunkStateKernel.EqualsTheAtenPath/*"
  "batched_copy_test:BatchedCopy.*"
)
# --error-exitcode: otherwise compute-sanitizer exits with the application's status, 0 after an
# error it reported. PYTORCH_NO_CUDA_MEMORY_CACHING: every tensor its own cudaMalloc, so an access
# past a tensor's end leaves its allocation (the caching allocator's blocks would hide it).
for tool in memcheck racecheck; do
  # A clean run ends with memcheck's "ERROR SUMMARY: 0 errors" or racecheck's "RACECHECK SUMMARY:
  # 0 hazards displayed"; --racecheck-report all counts the hazards it deems benign too.
  extra=() clean='^========= ERROR SUMMARY: 0 errors'
  if [[ "$tool" == racecheck ]]; then
    extra=(--racecheck-report all) clean='^========= RACECHECK SUMMARY: 0 hazards'
  fi
  for c in "${cases[@]}"; do
    t="${c%%:*}" filter="${c#*:}"
    log="$logs/$tool-$t.log"
    start=$SECONDS
    rc=0
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 600 "$sanitizer" --tool "$tool" --error-exitcode 86 \
      --kernel-name kns=3dta7kernels --print-limit 20 "${extra[@]}" \
      "build-device/tests/$t" --gtest_filter="$filter" >"$log" 2>&1 || rc=$?
    summary="$(grep -a -E '^========= (ERROR|RACECHECK) SUMMARY' "$log" | tr '\n' ' ' || true)"
    ran="$(sed -n 's/^\[==========\] \([0-9]*\) tests\{0,1\} from .* ran\..*/\1/p' "$log")"
    echo "gpu_test: $tool $t: exit $rc in $((SECONDS - start)) s, ${ran:-no} test(s); $summary"
    if ((rc != 0)) || ! grep -a -q -E "$clean" "$log" || ((${ran:-0} == 0)); then
      ((${ran:-0} == 0)) && echo "gpu_test: no test of $t matched --gtest_filter=$filter" >&2
      status=1
      grep -a -E '^=========|Failure' "$log" | head -40 || true
    fi
  done
done
exit "$status"
