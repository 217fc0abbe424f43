#!/usr/bin/env bash
# The Hopper tree-attention kernels (kernels/hopper/, issue 17: forward and backward) on a GPU
# machine: builds with scripts/device_build.sh (carry .deps, which scripts/device_deps.sh fills,
# the CUTLASS headers included), or with --quick_build only the three binaries below, then runs
#   hopper_tree_attention_test  the Hopper forward and backward against the float64 reference and
#                               against the FlashAttention-2 kernels (DTA_HOPPER_ATTENTION=0,
#                               DTA_HOPPER_ATTENTION_BACKWARD=0), lse, prefix gradients added into
#                               strided views and the backward's bitwise determinism included;
#   tree_attention_test         the whole kernel suite, whose D = 128 cases now take the Hopper
#                               kernels both ways (D = 64 stays FlashAttention-2);
#   dta-attention-bench         TFLOP/s of ours FA2, ours Hopper fwd, ours Hopper fwd + Hopper bwd
#                               and PyTorch's flash side by side.
# Logs go to ${OUT:-build-device}/gpu_hopper_attention/. About 3 minutes on an H100 with the full
# build (2.5 of them building), under 1.5 minutes with --no_build.
#
#   scripts/gpu_hopper_attention.sh [--no_build | --quick_build] [--no_bench]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
build=1
bench=1
for arg in "$@"; do
  case "$arg" in
    --no_build) build=0 ;;
    --quick_build) build=2 ;;
    --no_bench) bench=0 ;;
    *) echo "gpu_hopper_attention: unknown argument $arg" >&2; exit 2 ;;
  esac
done
export LD_LIBRARY_PATH="$repo/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
logs="${OUT:-build-device}/gpu_hopper_attention"
mkdir -p "$logs"
if ((build == 1)); then
  start=$SECONDS
  scripts/device_build.sh >"$logs/build.log" 2>&1 || { tail -40 "$logs/build.log"; exit 1; }
  echo "gpu_hopper_attention: built in $((SECONDS - start)) s"
elif ((build == 2)); then
  start=$SECONDS
  # device_build.sh's configuration; only the binaries this script runs.
  cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$repo/.deps/usr;$repo/.deps/usr/lib/x86_64-linux-gnu/cmake" \
    -DDTA_PYTHON="$(command -v python3)" -DDTA_BUILD_BENCH=OFF >"$logs/build.log" 2>&1 &&
    cmake --build build-device -j"$(nproc)" --target hopper_tree_attention_test \
      tree_attention_test dta-attention-bench >>"$logs/build.log" 2>&1 ||
    { tail -40 "$logs/build.log"; exit 1; }
  echo "gpu_hopper_attention: built in $((SECONDS - start)) s"
fi
grep -E "dta: CUTLASS" "$logs/build.log" 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
status=0
for t in hopper_tree_attention_test tree_attention_test; do
  start=$SECONDS
  timeout 300 "build-device/tests/$t" >"$logs/$t.log" 2>&1 || status=1
  grep -E "^\[  |^T=|Failure|Skipped|error" "$logs/$t.log" || true
  echo "gpu_hopper_attention: $t took $((SECONDS - start)) s"
done
if ((bench)); then
  timeout 300 build-device/bin/dta-attention-bench >"$logs/attention_bench.log" 2>&1 || status=1
  cat "$logs/attention_bench.log"
fi
exit "$status"
