#!/usr/bin/env bash
# One H200, from the repo root with .deps/ carried: the build that computes a packed step's losses on
# DTA_LOSS_THREADS host threads; dta-bench with one thread and the default four, alternating.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench gpu_equivalence_test" DTA_DEVICE_BUILD_TIMEOUT=300
source scripts/device_session.sh
run_gtests gpu_equivalence_test
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
bench() {  # name config rollouts
  timeout 100 build-device/bin/dta-bench --rollouts=$3 --config=$2 --dtype=bfloat16 --check=false \
    --out_dir="/tmp/b-$1" --repeats=2 --methods=dta-bauto-gauto-pack >"$out/bench-$1.log" 2>&1
  echo "$1 exit $? at $((SECONDS - start)) s"; grep -a '^| dta' "/tmp/b-$1/results.md" | cut -d'|' -f2-3,9
}
for run in 1a 4a 1b 4b; do DTA_LOSS_THREADS=${run:0:1} bench 1.7b-threads-$run qwen3-1.7b /tmp/tau2.jsonl; done
for run in 1 4; do DTA_LOSS_THREADS=$run bench 8b-threads-$run qwen3-8b /tmp/tau2-8b.jsonl; done
