#!/usr/bin/env bash
# Data parallelism on the GPUs of one host (NCCL): dta-train on one GPU and on N GPUs
# (--distributed, one process per GPU) over the same tau2-bench-like batch, side by side. Records
# the gradient agreement (N ranks vs one rank, both bfloat16, and each against a float32 one-rank
# run as the reference), the throughput and scaling efficiency, and the split's balance against the
# paper's greedy baselines. Run on a multi-GPU machine from the repo root with .deps/ carried:
#
#   scripts/gpu_dp.sh [--no_build]      environment: RANKS (2), MODEL (qwen3-1.7b), SCALE (0.25),
#                                       STEPS (4), OUT (build-device/gpu_dp)
#
# Output: OUT/summary.md (the table), OUT/*.log, OUT/metrics-*.jsonl.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
ranks="${RANKS:-2}"
model="${MODEL:-qwen3-1.7b}"
scale="${SCALE:-0.25}"
steps="${STEPS:-4}"
out="${OUT:-build-device/gpu_dp}"
mkdir -p "$out"
export LD_LIBRARY_PATH="$repo/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on these machines
if [[ "${1:-}" != "--no_build" ]]; then
  scripts/device_build.sh >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
fi
bin=build-device/bin
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
data="$out/tau2-s$scale.jsonl"
[[ -s "$data" ]] || "$bin/dta-workload" --preset=tau2 --seed=1 --scale="$scale" --out="$data"
common=(--config="$model" --rollouts="$data" --device=cuda --method=dta --pack --block_size=-1 --steps="$steps"
        --lr=1e-6 --json)

echo "== one GPU, float32 (the reference) and bfloat16"
"$bin/dta-train" "${common[@]}" --dtype=float32 --steps=1 --dump_grads="$out/grads-1-f32.safetensors" \
  >"$out/one-f32.log" 2>&1
"$bin/dta-train" "${common[@]}" --dtype=bfloat16 --dump_grads="$out/grads-1.safetensors" \
  --metrics="$out/metrics-1.jsonl" >"$out/one.log" 2>&1

echo "== $ranks GPUs, bfloat16"
port=$((29000 + RANDOM % 1000))
pids=()
for ((rank = 0; rank < ranks; ++rank)); do
  RANK=$rank WORLD_SIZE=$ranks LOCAL_RANK=$rank MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$bin/dta-train" "${common[@]}" --dtype=bfloat16 --distributed --dump_grads="$out/grads-$ranks.safetensors" \
    --metrics="$out/metrics-$ranks.jsonl" >"$out/rank$rank.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
if ((status)); then tail -20 "$out"/rank*.log; exit 1; fi

python3 - "$out" "$ranks" <<'PY'
import json, statistics, sys
from pathlib import Path
import torch
from safetensors.torch import load_file

out, ranks = Path(sys.argv[1]), int(sys.argv[2])
ref = load_file(str(out / "grads-1-f32.safetensors"))
one = load_file(str(out / "grads-1.safetensors"))
many = load_file(str(out / f"grads-{ranks}.safetensors"))

def errors(a, b):
    return [float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)) for k in b]

def steps(name):
    rows = [json.loads(l) for l in (out / name).read_text().splitlines() if l.strip()]
    return rows, statistics.median(r["rollout_tokens_per_second"] for r in rows[1:]), max(r["peak_memory_gib"] for r in rows)

rows1, tps1, mem1 = steps("metrics-1.jsonl")
rowsn, tpsn, memn = steps(f"metrics-{ranks}.jsonl")
split = next(l for l in (out / "rank0.log").read_text().splitlines() if l.startswith("split over"))
lines = [
    f"| | 1 GPU | {ranks} GPUs |", "|---|---|---|",
    f"| rollout tokens / s (median of steps 2-{len(rows1)}) | {tps1:,.0f} | {tpsn:,.0f} |",
    f"| scaling efficiency | | {tpsn / (ranks * tps1):.1%} |",
    f"| peak memory per GPU (GiB) | {mem1:.2f} | {memn:.2f} |",
    f"| loss, step 1 | {rows1[0]['loss']:.6g} | {rowsn[0]['loss']:.6g} |",
    f"| median / max per-parameter gradient error vs float32 | {statistics.median(errors(one, ref)):.4f} / {max(errors(one, ref)):.4f} | {statistics.median(errors(many, ref)):.4f} / {max(errors(many, ref)):.4f} |",
    f"| median / max per-parameter gradient error vs 1 GPU bf16 | | {statistics.median(errors(many, one)):.4f} / {max(errors(many, one)):.4f} |",
    "", split,
]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
