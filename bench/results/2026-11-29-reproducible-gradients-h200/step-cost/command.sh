#!/usr/bin/env bash
# One H200: dta's step with the reproducible gathers (gather-rows/): Qwen3-1.7B, tau2 at scale
# 0.25, dta-pack, against 1.326 s for issue 17's final build on the same preset
# (../2026-11-29-issue-17-final-build-h200/kernels-tests-step/).
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench"
source scripts/device_session.sh
mkdir -p "$out/all"
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
timeout 100 build-device/bin/dta-bench --rollouts=/tmp/tau2.jsonl --config=qwen3-1.7b --dtype=bfloat16 \
  --check=false --out_dir=/tmp/tau2 --repeats=3 --methods=dta-bauto-gauto-pack >"$out/all/tau2.log" 2>&1
echo "tau2 exit $? at $((SECONDS - start)) s"; grep -a "^| dta" /tmp/tau2/results.md | cut -d'|' -f2,3,9
cp /tmp/tau2/results.md "$out/all/tau2.results.md"
(cd "$out" && tar czf all.tar.gz all && rm -rf all)
echo "done at $((SECONDS - start)) s"
