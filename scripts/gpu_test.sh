#!/usr/bin/env bash
# The GPU test run: builds on a GPU machine (scripts/device_build.sh, with .deps/ carried) and runs
# every test there, the GPU-only ones included: the tree-attention kernels against the float64
# reference and the fused layers' kernels against their ATen paths (tests/kernels), and the methods' equivalence on CUDA in float64, float32 and bfloat16
# (tests/executor/engine/gpu_equivalence_test.cc). Logs go to ${OUT:-build-device}/gpu_test/.
#
#   scripts/gpu_test.sh [--no_build] [CTEST ARGS...]     e.g. scripts/gpu_test.sh -R GpuEquivalence
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
build=1
if [[ "${1:-}" == "--no_build" ]]; then build=0; shift; fi
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
exit "$status"
