#!/usr/bin/env bash
# One H200, from the repo root with .deps/ carried: the build that also computes a packed step's losses
# before its backward; dta-bench both ways, step_gaps, and the 8B full step with the optimizer offloaded.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench dta-train dta-tree gpu_equivalence_test dta_python" DTA_DEVICE_BUILD_TIMEOUT=360
source scripts/device_session.sh
run_gtests gpu_equivalence_test
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
bench() {  # name config rollouts
  timeout 120 build-device/bin/dta-bench --rollouts=$3 --config=$2 --dtype=bfloat16 --check=false \
    --out_dir="/tmp/b-$1" --repeats=2 --methods=dta-bauto-gauto-pack >"$out/bench-$1.log" 2>&1
  echo "$1 exit $? at $((SECONDS - start)) s"; grep -a '^| dta' "/tmp/b-$1/results.md" | cut -d'|' -f2-3,9
}
for run in 0a 1a 1b; do DTA_LOSS_ROWS_ONLY=${run:0:1} bench 1.7b-$run qwen3-1.7b /tmp/tau2.jsonl; done
for run in 0 1; do DTA_LOSS_ROWS_ONLY=$run bench 8b-$run qwen3-8b /tmp/tau2-8b.jsonl; done
PYTHONPATH=$site timeout 150 python bench/step_gaps.py --rollouts=/tmp/tau2.jsonl --config=qwen3-1.7b --top=30 > $out/gaps-1.7b.txt 2>&1
echo "gaps exit $? at $((SECONDS - start)) s"; sed -n 3,8p $out/gaps-1.7b.txt
timeout 150 scripts/gpu_layout.sh --no_build --runs=8b:offload --auto_executor --tokens=140000 --steps=4 --out=/tmp/layout 2>&1 | tail -3
cp /tmp/layout/layout-8b-offload.jsonl /tmp/layout/layout.md $out/ 2>/dev/null
echo "done at $((SECONDS - start)) s"
