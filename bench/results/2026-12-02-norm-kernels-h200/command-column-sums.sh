#!/usr/bin/env bash
# One H200: the norms' column sums in two launches (column-sums-two-launches.diff applied to
# e3f315a): the fused-layer and tuned-GEMM GPU tests, the tau2 steps (1.7B, 8B), profiles of each
# step (step_gaps.py).
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench dta_python fused_layers_test tuned_matmul_test" DTA_DEVICE_BUILD_TIMEOUT=360
source scripts/device_session.sh
run_gtests fused_layers_test tuned_matmul_test
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
bench() {  # name config rollouts
  timeout 120 build-device/bin/dta-bench --rollouts=$3 --config=$2 --dtype=bfloat16 \
    --check=false --out_dir="/tmp/b-$1" --repeats=2 --methods=dta-bauto-gauto-pack \
    >"/tmp/bench-$1.log" 2>&1
  echo "$1 exit $? at $((SECONDS - start)) s"; grep -a '^| dta' "/tmp/b-$1/results.md" | cut -d'|' -f2-3,6,9
}
for run in a b; do bench 1.7b-$run qwen3-1.7b /tmp/tau2.jsonl; bench 8b-$run qwen3-8b /tmp/tau2-8b.jsonl; done
for m in 1.7b:tau2 8b:tau2-8b; do
  PYTHONPATH=$site timeout 150 python bench/step_gaps.py --rollouts=/tmp/${m#*:}.jsonl \
    --config=qwen3-${m%%:*} --top=40 > "$out/gaps-${m%%:*}.txt" 2>&1
  echo "gaps ${m%%:*} exit $? at $((SECONDS - start)) s"
  grep -E "GPU only|by kind|ColumnGroupSums|AddGroupSums|RmsNormB|RopeBack" "$out/gaps-${m%%:*}.txt" | head -12
done
echo "done at $((SECONDS - start)) s"
