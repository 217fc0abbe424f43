#!/usr/bin/env bash
export DTA_DEVICE_TARGETS="dta-train dta-workload dta-tree" DTA_DEVICE_BUILD_TIMEOUT=420
source scripts/device_session.sh
timeout 240 scripts/gpu_layout.sh --no_build --workload=long-agentic --tokens=226223 --runs=8b:offload \
  --steps=3 --auto_executor --out=/tmp/long 2>&1 | tail -4
echo "long done at $((SECONDS - start)) s"
timeout 200 scripts/gpu_layout.sh --no_build --runs=8b:offload --tokens=140000 --steps=3 --out=/tmp/tau2 2>&1 | tail -4
echo "tau2 done at $((SECONDS - start)) s"
for run in long tau2; do
  cp /tmp/$run/layout-8b-offload.jsonl $out/$run-layout-8b-offload.jsonl
  cp /tmp/$run/layout-8b-offload.log $out/$run-layout-8b-offload.log
  cp /tmp/$run/layout.md $out/$run-layout.md
done
head -3 /tmp/long/layout-8b-offload.log
