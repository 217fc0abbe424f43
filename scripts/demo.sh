#!/usr/bin/env bash
# The main job, on CPU: generate tau2-bench-like rollouts, show their prefix tree, schedule and
# split across 8 GPUs, then train a small random Qwen3 with GRPO for a few steps with dense and
# with dta on the same data, and compare loss, throughput and memory.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh"
"$repo/scripts/build.sh"
cd "$repo"
out=build/demo
mkdir -p "$out"
rm -f "$out"/dense.metrics.jsonl "$out"/dta.metrics.jsonl

echo "== 1. A tau2-bench-like batch (one task, 8 samples, every LLM call a rollout)"
build/bin/dta-workload --preset=tau2 --seed=1 --scale=0.05 --vocab_size=1024 --out="$out/tau2.jsonl"

echo; echo "== 2. Its prefix tree, push/pop schedule and partition"
build/bin/dta-tree --block_size=2048 --partitions=8 "$out/tau2.jsonl"

steps="${DTA_DEMO_STEPS:-3}"
for method in dense dta; do
  echo; echo "== 3. GRPO, $steps steps, method $method"
  build/bin/dta-train --config=examples/configs/qwen3-tiny.json --rollouts="$out/tau2.jsonl" \
    --method="$method" --loss=grpo --steps="$steps" --lr=1e-4 --block_size=2048 \
    --metrics="$out/$method.metrics.jsonl"
done

echo; echo "== 4. dta against dense"
.venv/bin/python examples/compare_methods.py "$out/dense.metrics.jsonl" "$out/dta.metrics.jsonl"
