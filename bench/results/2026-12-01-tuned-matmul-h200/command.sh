#!/usr/bin/env bash
# One H200: the tuned float32-accumulating GEMMs (kernels/tuned_matmul.h): their GPU tests, the
# tau2 steps with DTA_TUNED_MATMUL=0 / 1 alternating, and gpu_equivalence_test.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench tuned_matmul_test gpu_equivalence_test" DTA_DEVICE_BUILD_TIMEOUT=330
source scripts/device_session.sh
run_gtests tuned_matmul_test
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
bench() {  # name config rollouts tuned
  DTA_TUNED_MATMUL=$4 DTA_TUNED_MATMUL_REPORT=1 timeout 120 build-device/bin/dta-bench --rollouts=$3 --config=$2 --dtype=bfloat16 \
    --check=false --out_dir="/tmp/b-$1" --repeats=2 --methods=dta-bauto-gauto-pack \
    >"/tmp/bench-$1.log" 2>&1
  echo "$1 exit $? at $((SECONDS - start)) s"; grep -a '^| dta' "/tmp/b-$1/results.md" | cut -d'|' -f2-3,6,9
}
for run in 0a 1a 0b 1b; do bench 1.7b-tuned-$run qwen3-1.7b /tmp/tau2.jsonl ${run%?}; done
for run in 0a 1a 0b 1b; do bench 8b-tuned-$run qwen3-8b /tmp/tau2-8b.jsonl ${run%?}; done
for f in /tmp/bench-1.7b-tuned-1a.log /tmp/bench-8b-tuned-1a.log; do cp $f $out/;
  echo "$f: $(grep -c 'tuned matmul' $f) classes chosen"; grep 'tuned matmul' $f | head -40
done
run_gtests gpu_equivalence_test
echo "done at $((SECONDS - start)) s"
