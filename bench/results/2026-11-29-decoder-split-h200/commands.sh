#!/usr/bin/env bash
# The commands of this record, as they ran from the repo root (2026-11-29).
env DTA_DEVICE_TARGETS=dta-bench\ dta-workload scripts/device_build.sh >/root/out/2026-11-29-decoder-split-h200/build.log 2>&1
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/gpu_bench_set.552/preset-tau2-seed-1-scale-0.25.jsonl 2>/dev/null
timeout 150 build-device/bin/dta-bench --flagfile=bench/configs/qwen3-1.7b-tau2.flags --rollouts=/tmp/gpu_bench_set.552/preset-tau2-seed-1-scale-0.25.jsonl --out_dir=/root/out/2026-11-29-decoder-split-h200/qwen3-1.7b-tau2 --label=qwen3-1.7b-tau2 >/dev/null 2>/root/out/2026-11-29-decoder-split-h200/qwen3-1.7b-tau2/log.txt
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.2 --out=/tmp/gpu_bench_set.552/preset-tau2-seed-1-scale-0.2.jsonl 2>/dev/null
timeout 200 build-device/bin/dta-bench --flagfile=bench/configs/qwen3-8b-tau2.flags --rollouts=/tmp/gpu_bench_set.552/preset-tau2-seed-1-scale-0.2.jsonl --out_dir=/root/out/2026-11-29-decoder-split-h200/qwen3-8b-tau2 --label=qwen3-8b-tau2 >/dev/null 2>/root/out/2026-11-29-decoder-split-h200/qwen3-8b-tau2/log.txt
build-device/bin/dta-workload --preset=gsm8k --seed=1 --scale=0.3 --out=/tmp/gpu_bench_set.552/preset-gsm8k-seed-1-scale-0.3.jsonl 2>/dev/null
timeout 60 build-device/bin/dta-bench --flagfile=bench/configs/qwen3-1.7b-gsm8k.flags --rollouts=/tmp/gpu_bench_set.552/preset-gsm8k-seed-1-scale-0.3.jsonl --out_dir=/root/out/2026-11-29-decoder-split-h200/qwen3-1.7b-gsm8k --label=qwen3-1.7b-gsm8k >/dev/null 2>/root/out/2026-11-29-decoder-split-h200/qwen3-1.7b-gsm8k/log.txt
build-device/bin/dta-workload --preset=aime --seed=1 --scale=0.1 --out=/tmp/gpu_bench_set.552/preset-aime-seed-1-scale-0.1.jsonl 2>/dev/null
timeout 45 build-device/bin/dta-bench --flagfile=bench/configs/qwen3-1.7b-aime-4.flags --rollouts=/tmp/gpu_bench_set.552/preset-aime-seed-1-scale-0.1.jsonl --out_dir=/root/out/2026-11-29-decoder-split-h200/qwen3-1.7b-aime-4 --label=qwen3-1.7b-aime-4 >/dev/null 2>/root/out/2026-11-29-decoder-split-h200/qwen3-1.7b-aime-4/log.txt
