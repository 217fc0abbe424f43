#!/usr/bin/env bash
# One H200, from the repo root with .deps/ carried: a packed step's losses for all its rollouts at
# once (default) against rollout by rollout (DTA_BATCHED_LOSSES=0), alternating, and the GPU
# equivalence suite.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench gpu_equivalence_test" DTA_DEVICE_BUILD_TIMEOUT=330
source scripts/device_session.sh
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
bench() {  # name config rollouts
  timeout 100 build-device/bin/dta-bench --rollouts=$3 --config=$2 --dtype=bfloat16 --check=false \
    --out_dir="$out/b-$1" --repeats=2 --methods=dta-bauto-gauto-pack >"$out/bench-$1.log" 2>&1
  echo "$1 exit $? at $((SECONDS - start)) s"; grep -a '^| dta' "$out/b-$1/results.md" | cut -d'|' -f2-3,9
}
for run in 0a 1a 0b 1b; do DTA_BATCHED_LOSSES=${run:0:1} bench 1.7b-batched-$run qwen3-1.7b /tmp/tau2.jsonl; done
for run in 0 1; do DTA_BATCHED_LOSSES=$run bench 8b-batched-$run qwen3-8b /tmp/tau2-8b.jsonl; done
run_gtests gpu_equivalence_test
echo "done at $((SECONDS - start)) s"
