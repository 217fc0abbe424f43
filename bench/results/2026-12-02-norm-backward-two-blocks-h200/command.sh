#!/bin/bash
# One H200, one call. Two dta-bench binaries built on the development machine (Debian 12, LibTorch
# 2.11.0+cu130, nvcc 13.0 for sm_90) and stripped: build/bin/dta-bench-base at 12bf5ac, and
# build/bin/dta-bench-norm2 with kernels/fused_layers.cu as committed with this record (the RMSNorm
# kernels' weight and weight-gradient sums in shared memory, no launch bound: the record
# 2026-12-02-norm-kernels-h200's shared-memory-norms.diff without its 3-blocks bound); carried with
# build/bin/dta-workload and build/devlibs (the Abseil and simdjson libraries they link, copied from
# .deps/usr: the call's files must stay under 64 MiB).
# The RMSNorm kernels with the weight and weight-gradient sums in shared memory at ptxas's own
# register count (128 at 4,096-wide rows: 2 blocks per SM, no spills) against the default
# (registers, the backward at 160: 1 block per SM), in one call: each kernel's own time under
# Nsight Compute, then the 8B and 1.7B tau2 steps alternating.
source scripts/device_prebuilt.sh
export LD_LIBRARY_PATH=$PWD/build/devlibs:$LD_LIBRARY_PATH
start=$SECONDS
build/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl >/dev/null 2>&1
build/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl >/dev/null 2>&1
ls -la /tmp/tau2*.jsonl
step() {  # binary name config rollouts
  timeout 150 build/bin/dta-bench-$1 --rollouts=$4 --config=$3 --dtype=bfloat16 --check=false \
    --repeats=2 --methods=dta-bauto-gauto-pack --out_dir=/tmp/b-$2 > /tmp/bench-$2.log 2>&1
  echo "$2 exit $? at $((SECONDS - start)) s: $(grep -a '^| dta' /tmp/b-$2/results.md | cut -d'|' -f2-3,9)"
}
for b in base norm2; do
  for k in Backward Forward; do
    timeout 120 ncu --kernel-name regex:RmsNorm$k --launch-count 40 \
      --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active \
      --csv build/bin/dta-bench-$b --rollouts=/tmp/tau2-8b.jsonl --config=qwen3-8b --dtype=bfloat16 \
      --check=false --warmup=0 --repeats=1 --methods=dta-bauto-gauto-pack --out_dir=/tmp/ncu-$b > $out/ncu-8b-$k-$b.csv 2> /tmp/ncu-$b-$k.err
    echo "ncu $b $k exit $? at $((SECONDS - start)) s"; tail -2 /tmp/ncu-$b-$k.err
  done
done
step base 8b-base-1 qwen3-8b /tmp/tau2-8b.jsonl
step norm2 8b-norm2-1 qwen3-8b /tmp/tau2-8b.jsonl
step base 8b-base-2 qwen3-8b /tmp/tau2-8b.jsonl
step norm2 8b-norm2-2 qwen3-8b /tmp/tau2-8b.jsonl
step base 1.7b-base qwen3-1.7b /tmp/tau2.jsonl
step norm2 1.7b-norm2 qwen3-1.7b /tmp/tau2.jsonl
cp /tmp/b-8b-base-1/results.md $out/results-8b-base-1.md; cp /tmp/b-8b-norm2-1/results.md $out/results-8b-norm2-1.md
