#!/usr/bin/env bash
# The fourth call: the Hopper backward (helper-13's kernels) on the device: its tests, the
# attention bench, the equivalence suites, and dta's step with it on and off in one process.
# Logs under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
out="${OUT:-/tmp/out}"
mkdir -p "$out"
start=$SECONDS
# The machines lack grpc_tools, so the dta.v1 Python stubs fail to build; nothing here needs them.
timeout 300 scripts/device_build.sh -DDTA_BUILD_PYTHON=ON -DDTA_BUILD_SERVICES=OFF >"$out/build.log" 2>&1 ||
  grep -q "No module named 'grpc_tools'" "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
site=build-device/site && rm -rf "$site" && mkdir -p "$site" && cp -r bindings/python/dta "$site/dta" &&
  cp build-device/python/dta/_core*.so "$site/dta/"
echo "built at $((SECONDS - start)) s"
for t in hopper_tree_attention_test tree_attention_test chunk_attention_test gpu_equivalence_test; do
  timeout 200 build-device/tests/$t >"$out/$t.log" 2>&1
  echo "$t exit $?: $(grep -a -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
  grep -a -E "Failure" -A3 "$out/$t.log" | head -12
done
timeout 60 build-device/bin/dta-attention-bench >"$out/attention_bench.log" 2>&1; grep -a "^|" "$out/attention_bench.log"
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.002 --out="$out/tau2-s0.002.jsonl" 2>/dev/null
PYTHONPATH="$site" timeout 150 python3 bench/results/latest/h100-session-ab/ab.py "$out/tau2-s0.002.jsonl" \
  fa2=DTA_HOPPER_ATTENTION=0,DTA_HOPPER_ATTENTION_BACKWARD=0 hopper-fwd=DTA_HOPPER_ATTENTION_BACKWARD=0 \
  hopper= 2>&1 | grep -v Warn | tee "$out/ab.txt"
echo "done at $((SECONDS - start)) s"
