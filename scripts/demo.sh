#!/usr/bin/env bash
# The main job, on CPU: generate tau2-bench-like rollouts, show their prefix tree, schedule and
# split across 8 GPUs, then train a small random Qwen3 with GRPO for a few steps with dense and
# with dta on the same data, and compare loss, throughput and memory; finally the services: a
# dispatcher fed by a rollout worker, and two data-parallel trainer ranks training two steps from it.
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

echo; echo "== 5. The services: a dispatcher, two trainer ranks (Gloo on CPU) and a rollout worker"
if [[ -x build/bin/dta-dispatcher && -x build/bin/dta-trainer ]]; then
  services="$out/services"
  rm -rf "$services" && mkdir -p -m 700 "$services"  # private: the trainer token is created here
  port=$((50100 + RANDOM % 800))
  master=$((29100 + RANDOM % 800))
  build/bin/dta-dispatcher --wal="$services/dispatcher.wal" --listen="127.0.0.1:$port" --batch_rollouts=4 \
    --vocab_size=1024 2>"$services/dispatcher.log" &
  dispatcher=$!
  trap 'kill $dispatcher 2>/dev/null || true' EXIT
  # The trainers present the token the dispatcher creates beside its log once it listens.
  for _ in $(seq 300); do grep -q "listening on" "$services/dispatcher.log" && break; sleep 0.1; done
  trainers=()
  for rank in 0 1; do
    RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank MASTER_ADDR=127.0.0.1 MASTER_PORT=$master \
      build/bin/dta-trainer --dispatcher="127.0.0.1:$port" --token_file="$services/dispatcher.wal.trainer-token" \
      --checkpoint_dir="$services/checkpoints" \
      --config=examples/configs/qwen3-tiny.json --loss=grpo --lr=1e-4 --block_size=2048 --max_steps=2 \
      2>"$services/trainer$rank.log" &
    trainers+=($!)
  done
  build/bin/dta-send --dispatcher="127.0.0.1:$port" --rollouts="$out/tau2.jsonl"
  for pid in "${trainers[@]}"; do wait "$pid"; done
  kill -TERM "$dispatcher"; wait "$dispatcher" || true
  trap - EXIT
  grep -E "^step " "$services/dispatcher.log"
  echo "checkpoints (Hugging Face format, what rollout workers reload):"; ls "$services/checkpoints"
else
  echo "(skipped: built without gRPC)"
fi
