#!/usr/bin/env bash
# One device call (H100), from the repo root with .deps carried: build everything and the Python
# extension in build-device, the GPU tests of this change, the in-process A/B (ab.py) and the
# memory-budget benchmark. Logs under $OUT. Each stage has its own time limit.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
out="${OUT:-/tmp/out}"
mkdir -p "$out"
start=$SECONDS
stage() { echo "== $1 at $((SECONDS - start)) s"; }
stage build
# The machines lack grpc_tools, so the dta.v1 Python stubs fail to build; nothing here needs them.
timeout 300 scripts/device_build.sh -DDTA_BUILD_PYTHON=ON -DDTA_BUILD_SERVICES=OFF >"$out/build.log" 2>&1 ||
  grep -q "No module named 'grpc_tools'" "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
grep -E "CUTLASS" "$out/build.log" | head -2
site=build-device/site && rm -rf "$site" && mkdir -p "$site" && cp -r bindings/python/dta "$site/dta" &&
  cp build-device/python/dta/_core*.so "$site/dta/"
stage tests
for t in batched_copy_test fused_layers_test hopper_tree_attention_test tree_attention_test; do
  timeout 120 build-device/tests/$t >"$out/$t.log" 2>&1; echo "$t exit $?: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
done
timeout 200 build-device/tests/gpu_equivalence_test --gtest_filter='*MemoryBudget*:*Bfloat16*' >"$out/gpu_equivalence_test.log" 2>&1
echo "gpu_equivalence_test exit $?"; grep -E "^\[  (PASSED|FAILED)|Failure" "$out/gpu_equivalence_test.log" | head -20
stage workload
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.002 --out="$out/tau2-s0.002.jsonl" 2>/dev/null
stage ab
PYTHONPATH="$site" timeout 150 python3 bench/ab_env.py "$out/tau2-s0.002.jsonl" \
  before=DTA_BATCHED_COPY=0,DTA_HOPPER_ATTENTION=0 batched=DTA_HOPPER_ATTENTION=0 after= 2>&1 | tee "$out/ab.txt"
stage memory-budget
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out="$out/tau2-s0.25.jsonl" 2>/dev/null
timeout $((585 - (SECONDS - start))) build-device/bin/dta-bench --rollouts="$out/tau2-s0.25.jsonl" --config=qwen3-1.7b \
  --device=cuda --dtype=bfloat16 --methods=dense,dense-ckpt,dta-bauto-gauto-pack,dta-bauto-gauto-pack-mhalf \
  --check=false --repeats=2 --out_dir="$out/bench-budget" >"$out/bench-budget.log" 2>&1
echo "dta-bench exit $?"; cat "$out/bench-budget/results.md" 2>/dev/null | head -30 || tail -20 "$out/bench-budget.log"
stage done
