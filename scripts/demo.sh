#!/usr/bin/env bash
# The main job: generates a tau2-bench-like rollout batch and prints its prefix-tree statistics,
# its push/pop schedule and its partition across trainer GPUs.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh"
"$repo/scripts/build.sh"
cd "$repo"
mkdir -p build/demo
build/bin/dta-workload --preset=tau2 --seed=1 --out=build/demo/tau2.jsonl
build/bin/dta-tree --block_size=2048 --partitions=8 build/demo/tau2.jsonl
