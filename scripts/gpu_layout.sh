#!/usr/bin/env bash
# The layout benchmark: dta-train with the full AdamW step, for each model, on a dta-workload
# preset (tau2 by default), once per layout asked for, on one GPU or several of one host (NCCL,
# one process per GPU). Shows what offloading AdamW's state costs per step (streamed through the
# GPU or updated on the host, side by side with the GPU-resident optimizer where that fits), tensor
# against data parallelism on the same GPUs, and the planner's memory per GPU against the measured
# peak. dta runs without packing and with a graph budget of 4,096 tokens (--nopack
# --token_capacity=24576 --graph_budget=4096), as when docs/benchmarks.md's layout numbers were
# measured; --auto_executor runs the executor's defaults instead (packing, automatic block size
# and graph budget, sized beside the optimizer's state).
# Run on a GPU machine from the repo root, with .deps/ carried (scripts/device_deps.sh):
#
#   scripts/gpu_layout.sh [--runs=1.7b:gpu,1.7b:offload,8b:auto] [--tokens=140000] [--steps=3]
#                         [--workload=tau2] [--auto_executor] [--no_build] [--out=DIR]
#
#   --runs    MODEL:LAYOUT pairs; LAYOUT is one or more of these, joined by '+':
#               gpu      the optimizer on the GPU (--offload_optimizer=false)
#               offload  offloaded (--offload_optimizer=true), streamed through the GPU
#               host     with offload: updated on the host's cores (--offload_update=host)
#               auto     the planner's choice (printed in the log)
#               residentN  with offload: N GB of the state kept on the GPU (--offload_resident_gb=N;
#                        by default the planner fills the GPU's spare memory)
#               tpN      N-way tensor parallelism (--tensor_parallel=N)
#               dpN      N data-parallel replicas (sharded optimizer, the planner's default)
#             e.g. 8b:offload, 8b:offload+host, 8b:tp2+gpu, 8b:dp2. A run takes tp x dp GPUs.
#   --tokens  rollout tokens per step (the preset is generated at the scale that holds them).
#   --workload  the dta-workload preset (tau2; long-agentic for paths of 27K-51K tokens).
#   --steps   optimizer steps per run (the first includes allocation: read the later ones).
#
# Writes DIR/layout-MODEL-LAYOUT.{jsonl,log} (rank 0's per-step JSON: seconds, executor_seconds,
# optimizer_seconds, peak_memory_gib, host_peak_memory_gib, rollout_tokens_per_second; the log's
# first lines are the planned layout and memory) and DIR/layout.md, a table of the last step of
# every run.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

runs="1.7b:gpu,1.7b:offload,8b:auto"
tokens=140000
steps=3
build=1
preset=tau2
executor_flags=(--nopack --token_capacity=24576 --graph_budget=4096)
out="${OUT:-bench/results/layout}"
for arg in "$@"; do
  case "$arg" in
    --runs=*) runs="${arg#*=}" ;;
    --tokens=*) tokens="${arg#*=}" ;;
    --steps=*) steps="${arg#*=}" ;;
    --no_build) build=0 ;;
    --out=*) out="${arg#*=}" ;;
    --workload=*) preset="${arg#*=}" ;;
    --auto_executor) executor_flags=() ;;
    -h | --help) sed -n '2,33p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_layout: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done

export LD_LIBRARY_PATH="$repo/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
bin="$repo/build-device/bin"
if ((build)); then
  log="${TMPDIR:-/tmp}/gpu_layout_build.log"
  scripts/device_build.sh >"$log" 2>&1 || { tail -40 "$log" >&2; echo "gpu_layout: the build failed" >&2; exit 1; }
fi
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt" >&2 || true

# The preset at the scale holding about `tokens` rollout tokens.
full="$out/$preset-s1.jsonl"
[[ -s "$full" ]] || "$bin/dta-workload" --preset="$preset" --seed=1 --scale=1 --out="$full" >/dev/null
full_tokens="$("$bin/dta-tree" --json "$full" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tree"]["rollout_tokens"])')"
scale="$(python3 -c "print(round(min(1.0, $tokens / $full_tokens), 3))")"
workload="$out/$preset-s$scale.jsonl"
[[ -s "$workload" ]] || "$bin/dta-workload" --preset="$preset" --seed=1 --scale="$scale" --out="$workload" >/dev/null
"$bin/dta-tree" "$workload" | head -3 >&2

IFS=, read -r -a pairs <<<"$runs"
for pair in "${pairs[@]}"; do
  model="${pair%%:*}"
  layout="${pair#*:}"
  flags=()
  tp=1
  dp=1
  IFS=+ read -r -a parts <<<"$layout"
  for part in "${parts[@]}"; do
    case "$part" in
      gpu) flags+=(--offload_optimizer=false) ;;
      offload) flags+=(--offload_optimizer=true) ;;
      host) flags+=(--offload_update=host) ;;
      auto) ;;
      resident[0-9]*) flags+=(--offload_resident_gb="${part#resident}") ;;
      tp[0-9]*) tp="${part#tp}"; flags+=(--tensor_parallel="$tp") ;;
      dp[0-9]*) dp="${part#dp}" ;;
      *) echo "gpu_layout: unknown layout part '$part' (gpu, offload, host, auto, residentN, tpN, dpN)" >&2; exit 2 ;;
    esac
  done
  ranks=$((tp * dp))
  name="layout-$model-${layout//+/_}"  # no "+" in file names: some transfers refuse them
  rm -f "$out/$name.jsonl"
  echo "gpu_layout: qwen3-$model, $layout on $ranks GPU(s)" >&2
  args=(--config="qwen3-$model" --rollouts="$workload" --dtype=bfloat16 --device=cuda
        --method=dta "${executor_flags[@]}" --lr=1e-6 --steps="$steps" --json
        --metrics="$out/$name.jsonl" "${flags[@]}")
  status=0
  if ((ranks == 1)); then
    "$bin/dta-train" "${args[@]}" >/dev/null 2>"$out/$name.log" || status=$?
  else
    port=$((29000 + RANDOM % 1000))
    pids=()
    for ((rank = 0; rank < ranks; ++rank)); do
      log="$out/$name.log"
      ((rank == 0)) || log="$out/$name.rank$rank.log"
      RANK=$rank WORLD_SIZE=$ranks LOCAL_RANK=$rank LOCAL_WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=$port "$bin/dta-train" "${args[@]}" --distributed >/dev/null 2>"$log" &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
  fi
  grep -h "layout:\|offload" "$out/$name.log" >&2 || true
  ((status == 0)) || { tail -5 "$out/$name"*.log >&2; echo "gpu_layout: $name exited with $status" >&2; }
done

python3 - "$out" <<'PY'
import glob, json, os, re, sys
out = sys.argv[1]
rows = ["| model | layout asked | layout (printed by dta-train) | planned GiB per GPU | GPU peak GiB | step s | executor s | optimizer s | rollout tok/s | host peak GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
for path in sorted(glob.glob(os.path.join(out, "layout-*.jsonl"))):
    lines = [json.loads(l) for l in open(path) if l.strip()]
    if not lines:
        continue
    last = lines[-1]
    _, model, layout = os.path.basename(path)[:-6].split("-", 2)
    log = open(path[:-6] + ".log").read()
    line = next((l.split("layout: ", 1)[1] for l in log.splitlines() if "layout: " in l), "?")
    plan = line.split(" for ")[0]
    planned = re.search(r"per GPU ([0-9.]+) GiB", line)
    rows.append(f"| qwen3-{model} | {layout} | {plan} | {planned.group(1) if planned else '?'} | "
                f"{last['peak_memory_gib']:.1f} | {last['seconds']:.2f} | {last['executor_seconds']:.2f} | "
                f"{last['optimizer_seconds']:.2f} | {last['rollout_tokens_per_second']:,.0f} | "
                f"{last['host_peak_memory_gib']:.1f} |")
open(os.path.join(out, "layout.md"), "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
PY
