#!/usr/bin/env bash
# One H200, from the repo root with .deps/ carried: the build of the day's last commit on the
# batches of the dense-model targets: Qwen3-8B on paths to 44K tokens (dta), and the tau2 steps
# beside our dense baselines (1.7B: dense, dense-ckpt, dta; 8B: dense-ckpt, dta).
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench" DTA_DEVICE_BUILD_TIMEOUT=240
source scripts/device_session.sh
bin=build-device/bin
$bin/dta-workload --preset=long-agentic --seed=1 --scale=0.25 --out=/tmp/long.jsonl 2>/dev/null
$bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
$bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
bench() {  # name config rollouts repeats methods
  timeout 150 $bin/dta-bench --rollouts=$3 --config=$2 --dtype=bfloat16 --check=false \
    --out_dir="/tmp/b-$1" --repeats=$4 --methods=$5 >"$out/bench-$1.log" 2>&1
  echo "$1 exit $? at $((SECONDS - start)) s"; grep -a '^| d' "/tmp/b-$1/results.md" | cut -d'|' -f2-3,5,7,9
}
bench long-8b qwen3-8b /tmp/long.jsonl 1 dta-bauto-gauto-pack
bench tau2-1.7b qwen3-1.7b /tmp/tau2.jsonl 1 dense,dense-ckpt,dta-bauto-gauto-pack
bench tau2-8b qwen3-8b /tmp/tau2-8b.jsonl 1 dense-ckpt,dta-bauto-gauto-pack
echo "done at $((SECONDS - start)) s"
