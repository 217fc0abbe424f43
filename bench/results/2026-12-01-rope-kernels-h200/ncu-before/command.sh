#!/usr/bin/env bash
# One H200, from the repo root with .deps/ carried: Nsight Compute on the fused layers' kernels in
# dta's Qwen3-1.7B tau2 step (a few launches of each, after the first ones).
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench" DTA_DEVICE_BUILD_TIMEOUT=330
source scripts/device_session.sh
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
for k in RopeBackwardKernel RopeForwardKernel RmsNormBackwardKernel SwiGluBackwardKernel; do
  timeout 120 ncu --clock-control none --kernel-name regex:"$k" --launch-skip 40 --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    build-device/bin/dta-bench --rollouts=/tmp/tau2.jsonl --config=qwen3-1.7b --dtype=bfloat16 \
    --check=false --warmup=0 --repeats=1 --methods=dta-bauto-gauto-pack --out_dir=/tmp/b-$k \
    > "$out/ncu-$k.txt" 2>&1
  echo "$k exit $? at $((SECONDS - start)) s"
  grep -aE "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Grid Size|Block Size" "$out/ncu-$k.txt" | head -18
done
echo "done at $((SECONDS - start)) s"
