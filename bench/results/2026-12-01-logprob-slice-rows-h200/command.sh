#!/usr/bin/env bash
# One H200, from the repo root with .deps/ carried: the LM head's slice of rows (512, the default,
# against 1,024 and 2,048), alternating, and step_gaps profiles of the 1.7B and 8B tau2 steps.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench dta_python" DTA_DEVICE_BUILD_TIMEOUT=330
source scripts/device_session.sh
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
bench() {  # name config rollouts slice_rows
  timeout 100 build-device/bin/dta-bench --rollouts=$3 --config=$2 --dtype=bfloat16 --check=false \
    --out_dir="$out/b-$1" --repeats=2 --methods=dta-bauto-gauto-pack --logprob_slice_rows=$4 \
    >"$out/bench-$1.log" 2>&1
  echo "$1 exit $? at $((SECONDS - start)) s"; grep -a '^| dta' "$out/b-$1/results.md" | cut -d'|' -f2-3,6,9
}
for run in 512a 2048a 1024a 512b 2048b; do bench 1.7b-slice-$run qwen3-1.7b /tmp/tau2.jsonl ${run%?}; done
for run in 512 2048; do bench 8b-slice-$run qwen3-8b /tmp/tau2-8b.jsonl $run; done
for m in 1.7b:tau2 8b:tau2-8b; do
  PYTHONPATH=$site timeout 150 python bench/step_gaps.py --rollouts=/tmp/${m#*:}.jsonl \
    --config=qwen3-${m%:*} --top=40 > $out/gaps-${m%:*}.txt 2>&1
  echo "gaps ${m%:*} exit $? at $((SECONDS - start)) s"; sed -n 3,9p $out/gaps-${m%:*}.txt
done
echo "done at $((SECONDS - start)) s"
