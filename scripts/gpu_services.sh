#!/usr/bin/env bash
# The gRPC services end to end on one machine: dta-dispatcher, one dta-trainer and dta-send with a
# tau2-bench-like batch (27 rollouts), two GRPO steps of a model preset with random weights, each
# step published as a checkpoint. On a GPU machine (scripts/device_session.sh with
# DTA_DEVICE_SERVICES=1 builds the binaries in build-device/bin) or here (BIN=build/bin
# DEVICE=cpu CONFIG=qwen3-tiny... for a smoke run). Prints the trainer's step lines and exits
# non-zero if a process fails or the two steps are not published.
#   BIN (build-device/bin), DEVICE (cuda), CONFIG (qwen3-0.6b), DTYPE (bfloat16), WORK (a temp dir)
set -uo pipefail
bin="${BIN:-build-device/bin}"
device="${DEVICE:-cuda}"
config="${CONFIG:-qwen3-0.6b}"
dtype="${DTYPE:-bfloat16}"
work="${WORK:-$(mktemp -d)}"
port=$((20000 + RANDOM % 20000))
mkdir -p "$work"
"$bin/dta-workload" --preset=tau2 --seed=1 --scale=0.1 --vocab_size="${VOCAB:-151936}" \
  --out="$work/tau2.jsonl" || exit 1
"$bin/dta-dispatcher" --wal="$work/dispatcher.wal" --listen="127.0.0.1:$port" \
  --vocab_size="${VOCAB:-151936}" --batch_rollouts=13 >"$work/dispatcher.log" 2>&1 &
dispatcher=$!
trap 'kill $dispatcher 2>/dev/null' EXIT
for _ in $(seq 50); do [[ -f "$work/dispatcher.wal.trainer-token" ]] && break; sleep 0.2; done
start=$SECONDS
timeout 300 "$bin/dta-trainer" --dispatcher="127.0.0.1:$port" \
  --token_file="$work/dispatcher.wal.trainer-token" --checkpoint_dir="$work/checkpoints" \
  --config="$config" --dtype="$dtype" --device="$device" --pack --block_size=-1 --loss=grpo \
  --lr=1e-6 --max_steps=2 --wait_s=120 >"$work/trainer.log" 2>&1 &
trainer=$!
timeout 120 "$bin/dta-send" --dispatcher="127.0.0.1:$port" --rollouts="$work/tau2.jsonl" \
  >"$work/send.log" 2>&1
send_rc=$?
wait $trainer
trainer_rc=$?
echo "dta-send exit $send_rc, dta-trainer exit $trainer_rc after $((SECONDS - start)) s ($device, $config, $dtype)"
grep -E "step|published|checkpoint" "$work/trainer.log" | tail -8
tail -3 "$work/send.log"
published=$(find "$work/checkpoints" -name config.json 2>/dev/null | wc -l)
echo "published checkpoints: $published"
if ((send_rc != 0 || trainer_rc != 0 || published < 1)); then
  echo "--- trainer log"; tail -30 "$work/trainer.log"
  echo "--- dispatcher log"; tail -10 "$work/dispatcher.log"
  exit 1
fi
