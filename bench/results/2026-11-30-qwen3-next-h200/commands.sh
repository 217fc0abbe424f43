#!/usr/bin/env bash
# The commands of this record, as they ran from the repo root (2026-11-30).
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/gpu_bench_set.2139/preset-tau2-seed-1-scale-0.25.jsonl 2>/dev/null
timeout 560 build-device/bin/dta-bench --flagfile=bench/configs/qwen3-next-80b-a3b-8l-tau2.flags --rollouts=/tmp/gpu_bench_set.2139/preset-tau2-seed-1-scale-0.25.jsonl --out_dir=/root/out/bench/2026-11-30-qwen3-next-h200/qwen3-next-80b-a3b-8l-tau2 --label=qwen3-next-80b-a3b-8l-tau2 >/dev/null 2>/root/out/bench/2026-11-30-qwen3-next-h200/qwen3-next-80b-a3b-8l-tau2/log.txt
