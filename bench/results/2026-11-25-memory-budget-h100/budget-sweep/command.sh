#!/usr/bin/env bash
# The second device call of this build (H100): the memory-budget GPU test after its fix, and
# dta under budgets that leave room above the weights, gradients and path stack (half of dense's
# peak does not: see ../budget-and-batched-copies/'s refusal). Logs under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
out="${OUT:-/tmp/out}"
mkdir -p "$out"
start=$SECONDS
timeout 300 scripts/device_build.sh >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
echo "built at $((SECONDS - start)) s"
timeout 150 build-device/tests/gpu_equivalence_test --gtest_filter='*MemoryBudget*' >"$out/gpu_equivalence_budget.log" 2>&1
echo "gpu_equivalence_test exit $?"; grep -a -E "^\[  (PASSED|FAILED)|Failure|budget" "$out/gpu_equivalence_budget.log" | head -60
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out="$out/tau2-s0.25.jsonl" 2>/dev/null
timeout $((590 - (SECONDS - start))) build-device/bin/dta-bench --rollouts="$out/tau2-s0.25.jsonl" --config=qwen3-1.7b \
  --device=cuda --dtype=bfloat16 --warmup=1 --repeats=2 --check=false --out_dir="$out/bench-budget" \
  --methods=dense-ckpt,dta-bauto-gauto-pack-m14,dta-bauto-gauto-pack-m16,dta-bauto-gauto-pack-m20,dta-b2048 \
  >"$out/bench-budget.log" 2>&1
echo "dta-bench exit $?"; head -30 "$out/bench-budget/results.md"
