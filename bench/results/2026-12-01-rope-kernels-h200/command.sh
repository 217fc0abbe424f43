#!/usr/bin/env bash
# One H200, from the repo root with .deps/ carried: the RoPE kernels with their rotary table and
# rstd loaded with the rows' values and the backward's grid at most one wave: the kernel tests,
# Nsight Compute on the same launches as the record's ncu-before/, the step, the GPU equivalence.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench fused_layers_test gpu_equivalence_test" DTA_DEVICE_BUILD_TIMEOUT=330
source scripts/device_session.sh
run_gtests fused_layers_test
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
for k in RopeBackwardKernel RopeForwardKernel; do
  timeout 120 ncu --clock-control none --kernel-name regex:"$k" --launch-skip 40 --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    build-device/bin/dta-bench --rollouts=/tmp/tau2.jsonl --config=qwen3-1.7b --dtype=bfloat16 \
    --check=false --warmup=0 --repeats=1 --methods=dta-bauto-gauto-pack --out_dir=/tmp/b-$k \
    > "$out/ncu-$k.txt" 2>&1
  echo "$k exit $? at $((SECONDS - start)) s"
  grep -aE "Duration|DRAM Throughput|Registers Per|Grid Size|Achieved Occupancy" "$out/ncu-$k.txt" | head -10
done
bench() {  # name config rollouts
  timeout 100 build-device/bin/dta-bench --rollouts=$3 --config=$2 --dtype=bfloat16 --check=false \
    --out_dir="/tmp/b-$1" --repeats=2 --methods=dta-bauto-gauto-pack >"$out/bench-$1.log" 2>&1
  echo "$1 exit $? at $((SECONDS - start)) s"; grep -a '^| dta' "/tmp/b-$1/results.md" | cut -d'|' -f2-3,7,9
}
for run in a b; do bench 1.7b-$run qwen3-1.7b /tmp/tau2.jsonl; done
bench 8b qwen3-8b /tmp/tau2-8b.jsonl
run_gtests gpu_equivalence_test
echo "done at $((SECONDS - start)) s"
