#!/usr/bin/env bash
# One H200, the build of commit aacfb1c (dependent launches): fused_layers_test's dependent-launch
# and RMSNorm cases, then dta-bench on tau2 with explicit block sizes beside the automatic one
# (Qwen3-1.7B: B = 8K (automatic), 16K, 32K; Qwen3-8B: 8K (automatic), 16K), each with the
# automatic graph budget (what B leaves of the memory's graph tokens). Logs under $OUT.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench fused_layers_test" DTA_DEVICE_BUILD_TIMEOUT=400
source scripts/device_session.sh
timeout 100 build-device/tests/fused_layers_test --gtest_filter='*Dependent*:*RmsNorm*' > "$out/fused_layers_test.log" 2>&1
echo "fused_layers_test exit $?: $(grep -c '^\[       OK' $out/fused_layers_test.log) ok, $(grep -c '^\[  FAILED' $out/fused_layers_test.log) failed"
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
bench() {  # name config rollouts methods
  timeout 200 build-device/bin/dta-bench --rollouts=$3 --config=$2 --dtype=bfloat16 --check=false \
    --out_dir="/tmp/b-$1" --repeats=2 --methods=$4 >"$out/bench-$1.log" 2>&1
  echo "$1 exit $?"; grep -a '^| dta' "/tmp/b-$1/results.md" | cut -d'|' -f2-3,9; grep -a "ran with B" "/tmp/b-$1/results.md"
}
bench 1.7b qwen3-1.7b /tmp/tau2.jsonl dta-bauto-gauto-pack,dta-b16384-gauto-pack,dta-b32768-gauto-pack
bench 8b qwen3-8b /tmp/tau2-8b.jsonl dta-bauto-gauto-pack,dta-b16384-gauto-pack
