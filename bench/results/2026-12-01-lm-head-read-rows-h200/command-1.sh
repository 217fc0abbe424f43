#!/usr/bin/env bash
# One H200, from the repo root with .deps/ carried (scripts/device_deps.sh): the build with the LM head on
# read rows only; dta-bench with DTA_LOSS_ROWS_ONLY=0 and default, alternating, then step_gaps.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench gpu_equivalence_test dta_python" DTA_DEVICE_BUILD_TIMEOUT=360
source scripts/device_session.sh
run_gtests gpu_equivalence_test
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
bench() {  # name config rollouts
  timeout 120 build-device/bin/dta-bench --rollouts=$3 --config=$2 --dtype=bfloat16 --check=false \
    --out_dir="/tmp/b-$1" --repeats=2 --methods=dta-bauto-gauto-pack >"$out/bench-$1.log" 2>&1
  echo "$1 exit $? at $((SECONDS - start)) s"; grep -a '^| dta' "/tmp/b-$1/results.md" | cut -d'|' -f2-3,9; grep -a "LM head runs\|ran with B" "/tmp/b-$1/results.md"
  cp /tmp/b-$1/results.md $out/results-$1.md
}
for run in 0a 1a 0b 1b; do DTA_LOSS_ROWS_ONLY=${run:0:1} bench 1.7b-$run qwen3-1.7b /tmp/tau2.jsonl; done
for sw in 0 1; do DTA_LOSS_ROWS_ONLY=$sw bench 8b-$sw qwen3-8b /tmp/tau2-8b.jsonl; done
PYTHONPATH=$site timeout 150 python bench/step_gaps.py --rollouts=/tmp/tau2.jsonl --config=qwen3-1.7b --top=30 > $out/gaps-1.7b.txt 2>&1
echo "gaps exit $? at $((SECONDS - start)) s"; sed -n 3,8p $out/gaps-1.7b.txt
