#!/usr/bin/env bash
# The dispatcher's targets on this machine (issue 5): ingestion throughput with durability on
# (every acknowledgement after fdatasync), acknowledgement latency at half the 2M tokens/s target,
# and planning a 4,096 x 16K-token step. Starts its own dta-dispatcher on a free loopback port with
# a log on disk (not tmpfs: syncs must reach a device), then stops it and removes the log.
#
#   scripts/ingest_bench.sh [SECONDS]     (default 10 per measurement)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-10}"
bin="${DTA_BUILD_DIR:-$repo/build}/bin"
for tool in dta-dispatcher dta-ingest-bench dta-plan-bench; do
  [[ -x "$bin/$tool" ]] || { echo "ingest_bench: $bin/$tool missing: run scripts/build.sh" >&2; exit 2; }
done
work="$(mktemp -d "$repo/build/ingest-bench.XXXXXX")"
port="$("$repo/.venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$bin/dta-dispatcher" --wal="$work/bench.wal" --vocab_size=151936 --batch_rollouts=100000000 \
  --max_pending=100000000 --listen="127.0.0.1:$port" >"$work/dispatcher.log" 2>&1 &
dispatcher=$!
trap 'kill "$dispatcher" 2>/dev/null || true; wait "$dispatcher" 2>/dev/null || true; rm -rf "$work"' EXIT
sleep 1
echo "== $(nproc) cores, $(uname -n), $(date -u +%F); log on $(df --output=source "$work" | tail -1)"
echo "== ingestion, as fast as acknowledgements allow (16 streams, 4,096-token trajectories)"
"$bin/dta-ingest-bench" --dispatcher="127.0.0.1:$port" --streams=16 --seconds="$seconds" --id_prefix=max
echo "== acknowledgement latency at 1M rollout tokens/s (half the 2M target)"
"$bin/dta-ingest-bench" --dispatcher="127.0.0.1:$port" --streams=16 --seconds="$seconds" --id_prefix=half --rate=1000000
echo "== planning one step: 4,096 rollouts x 16,384 tokens over 8 trainers"
"$bin/dta-plan-bench" --benchmark_min_time=1
