#!/usr/bin/env bash
# One H200: the tuned float32 accumulations (kernels/tuned_matmul.h) on the long-path 8B step
# (chunk-length products), DTA_TUNED_MATMUL=0 / 1; the 8B tau2 profile with dependent launches off
# (each kernel's own time, without the wait for its predecessor); gpu_equivalence_test.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench dta_python gpu_equivalence_test" DTA_DEVICE_BUILD_TIMEOUT=360
source scripts/device_session.sh
build-device/bin/dta-workload --preset=long-agentic --seed=1 --scale=0.25 --out=/tmp/long.jsonl 2>/dev/null
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
for tuned in 0 1; do
  DTA_TUNED_MATMUL=$tuned DTA_TUNED_MATMUL_REPORT=1 timeout 150 build-device/bin/dta-bench --config=qwen3-8b \
    --dtype=bfloat16 --check=false --repeats=1 --methods=dta-bauto-gauto-pack --rollouts=/tmp/long.jsonl \
    --out_dir=/tmp/long-$tuned > /tmp/long-$tuned.log 2>&1
  echo "long tuned=$tuned exit $? at $((SECONDS - start)) s"; grep -a '^| dta' /tmp/long-$tuned/results.md | cut -d'|' -f2-3,6,9
  grep -a "forwarded" /tmp/long-$tuned/results.md
done
cp /tmp/long-1.log $out/bench-long-8b-tuned.log
DTA_DEPENDENT_LAUNCH=0 PYTHONPATH=$site timeout 150 python bench/step_gaps.py --rollouts=/tmp/tau2-8b.jsonl \
  --config=qwen3-8b --top=40 > "$out/gaps-8b-no-dependent-launch.txt" 2>&1
echo "gaps exit $? at $((SECONDS - start)) s"
grep -E "GPU only|by kind|ColumnSums|RmsNormB|RopeBack|SwiGluBa" "$out/gaps-8b-no-dependent-launch.txt" | head -8
run_gtests gpu_equivalence_test
echo "done at $((SECONDS - start)) s"
