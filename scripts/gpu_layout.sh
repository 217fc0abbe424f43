#!/usr/bin/env bash
# The layout benchmark on one GPU: dta-train with the full AdamW step, for each model, on the
# tau2-like workload, once per optimizer layout asked for. Shows what offloading AdamW's state to
# the host costs per step (side by side with the GPU-resident optimizer where that fits) and that
# a model whose state does not fit on the GPU (Qwen3-8B on 80 GB) trains with it.
# Run on a GPU machine from the repo root, with .deps/ carried (scripts/device_deps.sh):
#
#   scripts/gpu_layout.sh [--runs=1.7b:gpu,1.7b:offload,8b:auto] [--tokens=140000] [--steps=3]
#                         [--no_build] [--out=DIR]
#
#   --runs    MODEL:LAYOUT pairs; LAYOUT is gpu (--offload_optimizer=false), offload (=true) or
#             auto (the planner's choice, printed in the log).
#   --tokens  rollout tokens per step (the tau2 preset is generated at the scale that holds them).
#   --steps   optimizer steps per run (the first includes allocation: read the later ones).
#
# Writes DIR/layout-MODEL-LAYOUT.{jsonl,log} (dta-train's per-step JSON: seconds, executor_seconds,
# optimizer_seconds, peak_memory_gib, host_peak_memory_gib, rollout_tokens_per_second) and
# DIR/layout.md, a table of the last step of every run.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

runs="1.7b:gpu,1.7b:offload,8b:auto"
tokens=140000
steps=3
build=1
out="${OUT:-bench/results/layout}"
for arg in "$@"; do
  case "$arg" in
    --runs=*) runs="${arg#*=}" ;;
    --tokens=*) tokens="${arg#*=}" ;;
    --steps=*) steps="${arg#*=}" ;;
    --no_build) build=0 ;;
    --out=*) out="${arg#*=}" ;;
    -h | --help) sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
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

# The tau2 preset at the scale holding about `tokens` rollout tokens.
full="$out/tau2-s1.jsonl"
[[ -s "$full" ]] || "$bin/dta-workload" --preset=tau2 --seed=1 --scale=1 --out="$full" >/dev/null
full_tokens="$("$bin/dta-tree" --json "$full" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tree"]["rollout_tokens"])')"
scale="$(python3 -c "print(round(min(1.0, $tokens / $full_tokens), 3))")"
workload="$out/tau2-s$scale.jsonl"
[[ -s "$workload" ]] || "$bin/dta-workload" --preset=tau2 --seed=1 --scale="$scale" --out="$workload" >/dev/null
"$bin/dta-tree" "$workload" | head -3 >&2

IFS=, read -r -a pairs <<<"$runs"
for pair in "${pairs[@]}"; do
  model="${pair%%:*}"
  layout="${pair#*:}"
  case "$layout" in
    gpu) flags=(--offload_optimizer=false) ;;
    offload) flags=(--offload_optimizer=true) ;;
    auto) flags=() ;;
    *) echo "gpu_layout: unknown layout '$layout' (gpu, offload, auto)" >&2; exit 2 ;;
  esac
  name="layout-$model-$layout"
  rm -f "$out/$name.jsonl"
  echo "gpu_layout: qwen3-$model, optimizer $layout" >&2
  status=0
  "$bin/dta-train" --config="qwen3-$model" --rollouts="$workload" --dtype=bfloat16 --device=cuda \
    --method=dta --token_capacity=24576 --graph_budget=4096 --lr=1e-6 --steps="$steps" --json \
    --metrics="$out/$name.jsonl" "${flags[@]}" >/dev/null 2>"$out/$name.log" || status=$?
  grep -h "layout:" "$out/$name.log" >&2 || true
  ((status == 0)) || { tail -5 "$out/$name.log" >&2; echo "gpu_layout: $name exited with $status" >&2; }
done

python3 - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = ["| model | optimizer | layout | step s | executor s | optimizer s | rollout tok/s | GPU peak GiB | host peak GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
for path in sorted(glob.glob(os.path.join(out, "layout-*.jsonl"))):
    lines = [json.loads(l) for l in open(path) if l.strip()]
    if not lines:
        continue
    last = lines[-1]
    _, model, layout = os.path.basename(path)[:-6].split("-", 2)
    log = open(path[:-6] + ".log").read()
    plan = next((l.split("layout: ", 1)[1].split(" for ")[0] for l in log.splitlines() if "layout: " in l), "?")
    rows.append(f"| qwen3-{model} | {layout} | {plan} | {last['seconds']:.2f} | {last['executor_seconds']:.2f} | "
                f"{last['optimizer_seconds']:.2f} | {last['rollout_tokens_per_second']:.0f} | "
                f"{last['peak_memory_gib']:.1f} | {last['host_peak_memory_gib']:.1f} |")
open(os.path.join(out, "layout.md"), "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
PY
