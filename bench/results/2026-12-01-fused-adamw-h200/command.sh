#!/usr/bin/env bash
# From the repo root on a GPU machine, .deps/ carried (scripts/device_deps.sh).
export DTA_DEVICE_TARGETS="adamw_update_test adamw_test sharded_adamw_test dta-train dta-workload dta-tree"
source scripts/device_session.sh
run_gtests adamw_update_test adamw_test sharded_adamw_test
# The same build, the fused kernel (default) and LibTorch's ops (DTA_FUSED_ADAMW=0).
for sw in 1 0; do
  DTA_FUSED_ADAMW=$sw scripts/gpu_layout.sh --no_build --runs=8b:offload --tokens=140000 --steps=4 \
    --out="$out/8b-offload-$sw"
  DTA_FUSED_ADAMW=$sw scripts/gpu_layout.sh --no_build --runs=1.7b:gpu --tokens=140000 --steps=3 \
    --out="$out/1.7b-gpu-$sw"
done
# Memory taken from the executor for more resident state (executor-memory-traded/).
w=/tmp/tau2-s0.101.jsonl
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=$w
for gb in 17 20; do
  build-device/bin/dta-train --config=qwen3-8b --rollouts=$w --dtype=bfloat16 --device=cuda \
    --method=dta --nopack --token_capacity=24576 --graph_budget=4096 --lr=1e-6 --steps=3 --json \
    --metrics="$out/activation-${gb}gb.jsonl" --offload_optimizer=true --activation_gb=$gb
done
python3 bench/results/2026-12-01-fused-adamw-h200/pcie_probe.py
