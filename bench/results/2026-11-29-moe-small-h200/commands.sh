#!/usr/bin/env bash
# The commands of this record, as they ran from the repo root (2026-11-29).
env DTA_DEVICE_TARGETS=dta-bench\ dta-workload scripts/device_build.sh >/root/out/2026-11-29-moe-small-h200/build.log 2>&1
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.1 --out=/tmp/gpu_bench_set.576/preset-tau2-seed-1-scale-0.1.jsonl 2>/dev/null
timeout 300 build-device/bin/dta-bench --flagfile=bench/configs/qwen3-moe-small-tau2.flags --rollouts=/tmp/gpu_bench_set.576/preset-tau2-seed-1-scale-0.1.jsonl --out_dir=/root/out/2026-11-29-moe-small-h200/qwen3-moe-small-tau2 --label=qwen3-moe-small-tau2 >/dev/null 2>/root/out/2026-11-29-moe-small-h200/qwen3-moe-small-tau2/log.txt
env DTA_MOE_ROWS=0 timeout 300 build-device/bin/dta-bench --flagfile=bench/configs/qwen3-moe-small-tau2-aten-rows.flags --rollouts=/tmp/gpu_bench_set.576/preset-tau2-seed-1-scale-0.1.jsonl --out_dir=/root/out/2026-11-29-moe-small-h200/qwen3-moe-small-tau2-aten-rows --label=qwen3-moe-small-tau2-aten-rows >/dev/null 2>/root/out/2026-11-29-moe-small-h200/qwen3-moe-small-tau2-aten-rows/log.txt
