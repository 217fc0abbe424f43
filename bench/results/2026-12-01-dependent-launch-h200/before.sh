#!/usr/bin/env bash
# One H200, the build before dependent launches (commit 418b7d0): the weight-gradient GEMM probe
# (dw_probe.py) and bench/step_gaps.py on tau2 at Qwen3-1.7B and Qwen3-8B. Logs under $OUT.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta_python dta-workload" DTA_DEVICE_BUILD_TIMEOUT=400
source scripts/device_session.sh
timeout 120 python3 bench/results/2026-12-01-dependent-launch-h200/dw_probe.py > "$out/dw_probe.txt" 2>&1; echo "probe exit $?"
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
export PYTHONPATH="$site"
timeout 200 python3 bench/step_gaps.py --rollouts=/tmp/tau2.jsonl --config=qwen3-1.7b --top=30 > "$out/gaps-1.7b.txt" 2>&1
echo "gaps 1.7b exit $? at $((SECONDS - start)) s"
timeout 250 python3 bench/step_gaps.py --rollouts=/tmp/tau2-8b.jsonl --config=qwen3-8b --top=30 > "$out/gaps-8b.txt" 2>&1
echo "gaps 8b exit $? at $((SECONDS - start)) s"
