#!/usr/bin/env bash
# The main job. 1: a policy that learns through dta's services: a tiny Qwen3 learns a multi-turn
# tool-use task with a verifiable reward (examples/python/lookup_task.py) by on-policy GRPO: a
# rollout worker samples groups with branch points, streams them to dta-dispatcher, two dta-trainer
# ranks (Gloo) train a step and publish it, the worker reloads it and samples the next batch; once
# with dense trainers and once with dta from the same seed (in float64 they earn the same reward at
# every step), with a line per step and the learning curves in build/demo/learning/curve.png
# (docs/learning.md). 2-4: dta against dense on a tau2-bench-like batch: its prefix tree, schedule
# and split across 8 GPUs, then GRPO steps of a small random Qwen3 with each method (loss,
# throughput, memory).
#
# Usage: scripts/demo.sh [--device=cuda] [--skip_throughput] [LEARNING_DEMO_FLAGS...]
#   --device=cpu|cuda|cuda:N  where the trainers, the worker and the comparison's dta-train run
#   --skip_throughput         only part 1
#   any other flag goes to examples/python/learning_demo.py, e.g. --steps=N (40), --ranks=N (2;
#   one per GPU), --config=FILE (a bigger model's config.json), --dtype=float32|bfloat16 (float64),
#   --lr, --groups, --group_size, --answers, --seed, --methods=dta
# DTA_DEMO_STEPS: GRPO steps of each method in part 3 (default 1).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
device=cpu
throughput=1
learning_flags=()
for arg in "$@"; do
  case "$arg" in
    --device=*) device="${arg#--device=}"; learning_flags+=("$arg") ;;
    --skip_throughput) throughput=0 ;;
    *) learning_flags+=("$arg") ;;
  esac
done
"$repo/scripts/setup.sh"
"$repo/scripts/build.sh"
cd "$repo"
out=build/demo
mkdir -p "$out"

echo "== 1. A policy that learns: the lookup task through dta-dispatcher and dta-trainer, dense then dta"
if [[ -x build/bin/dta-dispatcher && -x build/bin/dta-trainer ]]; then
  .venv/bin/python examples/python/learning_demo.py --out="$out/learning" --plot="$out/learning/curve.png" \
    "${learning_flags[@]}"
else
  echo "(skipped: built without the services, DTA_BUILD_TOOLS=OFF or no gRPC)"
fi
((throughput)) || exit 0

rm -f "$out"/dense.metrics.jsonl "$out"/dta.metrics.jsonl
echo; echo "== 2. A tau2-bench-like batch (one task, 8 samples, every LLM call a rollout): its prefix tree,"
echo "      push/pop schedule and partition"
build/bin/dta-workload --preset=tau2 --seed=1 --scale=0.05 --vocab_size=1024 --out="$out/tau2.jsonl"
build/bin/dta-tree --block_size=2048 --partitions=8 "$out/tau2.jsonl"

steps="${DTA_DEMO_STEPS:-1}"
for method in dense dta; do
  echo; echo "== 3. GRPO on it, $steps step(s), method $method"
  build/bin/dta-train --config=examples/configs/qwen3-tiny.json --rollouts="$out/tau2.jsonl" \
    --method="$method" --loss=grpo --steps="$steps" --lr=1e-4 --block_size=2048 --device="$device" \
    --metrics="$out/$method.metrics.jsonl"
done

echo; echo "== 4. dta against dense"
.venv/bin/python examples/compare_methods.py "$out/dense.metrics.jsonl" "$out/dta.metrics.jsonl"
