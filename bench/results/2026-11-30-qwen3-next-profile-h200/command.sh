#!/usr/bin/env bash
# One H200 (of an nvidia-h200-x2 machine): a GPU-only profile of dta's gradient step on 4 of
# Qwen3-Next-80B-A3B's layers with their real shapes (3 Gated DeltaNet, 1 gated attention at head
# dim 256; 512 experts of width 512, top 10, a shared expert), tau2 at scale 0.25. Four layers, not
# the eight of ../2026-11-30-qwen3-next-h200/: the Python trainer allocates the offloaded AdamW
# state of the whole model in pinned host memory (13.8B parameters: ~154 GiB, more than the
# 128 GiB host), although the profile runs compute_gradients only.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta_python"
source scripts/device_session.sh
mkdir -p device-inputs
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=device-inputs/tau2-s0.25.jsonl 2>/dev/null
PYTHONPATH="$site" timeout 260 python3 bench/hf_baseline.py --rollouts=device-inputs/tau2-s0.25.jsonl \
  --config=bench/configs/qwen3-next-80b-a3b-4l.json --device=cuda --dtype=bfloat16 --json --repeats=2 \
  --methods=dta-pack --profile --no-profile_host --profile_top=40 >"$out/profile.txt" 2>"$out/profile.err"
