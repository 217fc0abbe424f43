#!/usr/bin/env bash
export DTA_DEVICE_TARGETS="dta-bench dta-train dta-workload dta-tree" DTA_DEVICE_BUILD_TIMEOUT=420
source scripts/device_session.sh
bin=build-device/bin
$bin/dta-workload --preset=long-agentic --seed=1 --scale=0.25 --out=/tmp/long.jsonl
timeout 300 $bin/dta-bench --config=qwen3-8b --device=cuda --dtype=bfloat16 --check=false --repeats=1 \
  --methods=dense-ckpt,dta-bauto-gauto-pack --rollouts=/tmp/long.jsonl --out_dir=$out/bench > $out/bench.log 2>&1
echo "bench rc=$? at $((SECONDS - start)) s"; cat $out/bench/results.md
timeout 240 scripts/gpu_layout.sh --no_build --workload=long-agentic --tokens=226223 --runs=8b:offload --steps=3 \
  --auto_executor --out=$out/layout 2>&1 | tail -12
echo done at $((SECONDS - start)) s
