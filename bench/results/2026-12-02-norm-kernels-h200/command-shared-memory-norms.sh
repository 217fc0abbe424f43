#!/usr/bin/env bash
# One H200 (shared-memory-norms.diff applied to e3f315a): the RMSNorm kernels keeping the weight and the weight-gradient sums in shared memory
# (3 blocks per SM at 4,096-wide rows): fused_layers_test, the tau2 steps, the 8B step's profile
# with dependent launches off (each kernel's own time), gpu_equivalence_test.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench dta_python fused_layers_test gpu_equivalence_test" DTA_DEVICE_BUILD_TIMEOUT=360
source scripts/device_session.sh
run_gtests fused_layers_test
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
bench() {  # name config rollouts
  timeout 120 build-device/bin/dta-bench --rollouts=$3 --config=$2 --dtype=bfloat16 \
    --check=false --out_dir="/tmp/b-$1" --repeats=2 --methods=dta-bauto-gauto-pack \
    >"/tmp/bench-$1.log" 2>&1
  echo "$1 exit $? at $((SECONDS - start)) s"; grep -a '^| dta' "/tmp/b-$1/results.md" | cut -d'|' -f2-3,6,9
}
bench 8b-a qwen3-8b /tmp/tau2-8b.jsonl; bench 1.7b-a qwen3-1.7b /tmp/tau2.jsonl; bench 8b-b qwen3-8b /tmp/tau2-8b.jsonl
cp /tmp/bench-8b-a.log /tmp/bench-1.7b-a.log $out/
DTA_DEPENDENT_LAUNCH=0 PYTHONPATH=$site timeout 150 python bench/step_gaps.py --rollouts=/tmp/tau2-8b.jsonl \
  --config=qwen3-8b --top=40 > "$out/gaps-8b-no-dependent-launch.txt" 2>&1
echo "gaps exit $? at $((SECONDS - start)) s"
grep -E "GPU only|by kind|RmsNorm|SwiGluBa" "$out/gaps-8b-no-dependent-launch.txt" | head -8
run_gtests gpu_equivalence_test
echo "done at $((SECONDS - start)) s"
