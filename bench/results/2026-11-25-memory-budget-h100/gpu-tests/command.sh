#!/usr/bin/env bash
# The third call: the memory-budget GPU test in bf16 (peak) and float64 (gradient), and every GPU
# suite this build's changes touch (the stack's batched copies, the norms' column sums, the
# Hopper forward under the chunk-attention entry point). Logs under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
out="${OUT:-/tmp/out}"
mkdir -p "$out"
start=$SECONDS
timeout 300 scripts/device_build.sh >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
echo "built at $((SECONDS - start)) s"
for t in gpu_equivalence_test chunk_attention_test chain_attention_test gated_delta_net_test chunk_state_recurrence_test; do
  timeout 240 build-device/tests/$t >"$out/$t.log" 2>&1
  echo "$t exit $?: $(grep -a -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
done
grep -a -E "budget|Failure" "$out/gpu_equivalence_test.log" | head -60
echo "done at $((SECONDS - start)) s"
