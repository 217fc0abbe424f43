#!/usr/bin/env bash
# The executor-memory calibration of the layout planner (core/layout/executor_memory.h): dta-train's
# peak GPU memory for several models, block sizes B, graph budgets and rollout lengths, beside what
# the planner estimates for the same settings (dta-layout --activation_gb=-1 prints it). Run on a
# GPU machine from the repo root, with .deps/ carried (scripts/device_deps.sh):
#
#   scripts/gpu_executor_memory.sh [--runs=RUN,...] [--steps=2] [--no_build] [--out=DIR]
#
#   --runs   MODEL:WORKLOAD:B:BUDGET[:pack][:gpu] quadruples, e.g. 1.7b:tau2:2048:0 or
#            8b:tau2:4096:4096; WORKLOAD is tau2 (the preset at scale 0.101: 27 rollouts, longest
#            7,821 tokens) or aime (scale 0.05: 16 rollouts, longest 16,384); B = auto for the
#            executor's automatic block size; gpu keeps AdamW's state on the GPU (default: offloaded
#            and streamed, so that the step's peak is the executor's plus weights and gradients).
#   --steps  optimizer steps per run (the last one is read).
#
# Writes DIR/executor-memory.tsv (one line per run: model, workload, B, budget, pack, optimizer,
# peak GiB of the last step, the planned line of dta-train) and each run's log and per-step JSON.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

runs="0.6b:tau2:2048:0,1.7b:tau2:2048:0,1.7b:tau2:auto:4096:gpu"
steps=2
build=1
out="${OUT:-bench/results/executor-memory}"
for arg in "$@"; do
  case "$arg" in
    --runs=*) runs="${arg#*=}" ;;
    --steps=*) steps="${arg#*=}" ;;
    --no_build) build=0 ;;
    --out=*) out="${arg#*=}" ;;
    -h | --help) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_executor_memory: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done

export LD_LIBRARY_PATH="$repo/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
bin="$repo/build-device/bin"
mkdir -p "$out"
if ((build)); then
  python="${DTA_PYTHON:-$(command -v python3)}"
  log="$out/build.log"
  { cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$repo/.deps/usr;$repo/.deps/usr/lib/x86_64-linux-gnu/cmake" \
      -DDTA_PYTHON="$python" -DDTA_BUILD_BENCH=OFF &&
    cmake --build build-device -j"$(nproc)" --target dta-train dta-workload dta-layout; } >"$log" 2>&1 ||
    { tail -40 "$log" >&2; echo "gpu_executor_memory: the build failed" >&2; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt" >&2 || true

workload_file() {
  case "$1" in
    tau2) echo "$out/tau2-s0.101.jsonl" ;;
    aime) echo "$out/aime-s0.05.jsonl" ;;
    *) echo "gpu_executor_memory: unknown workload '$1' (tau2, aime)" >&2; exit 2 ;;
  esac
}
[[ -s "$out/tau2-s0.101.jsonl" ]] ||
  "$bin/dta-workload" --preset=tau2 --seed=1 --scale=0.101 --out="$out/tau2-s0.101.jsonl" >&2
[[ -s "$out/aime-s0.05.jsonl" ]] ||
  "$bin/dta-workload" --preset=aime --seed=1 --scale=0.05 --out="$out/aime-s0.05.jsonl" >&2

tsv="$out/executor-memory.tsv"
printf 'model\tworkload\tB\tbudget\tpack\toptimizer\tpeak_gib\tseconds\tplanned\n' >"$tsv"
IFS=, read -r -a list <<<"$runs"
for run in "${list[@]}"; do
  IFS=: read -r -a f <<<"$run"
  model="${f[0]}" workload="${f[1]}" block="${f[2]}" budget="${f[3]}"
  pack=false optimizer=offload
  for extra in "${f[@]:4}"; do
    case "$extra" in
      pack) pack=true ;;
      gpu) optimizer=gpu ;;
      *) echo "gpu_executor_memory: unknown option '$extra' in '$run'" >&2; exit 2 ;;
    esac
  done
  [[ "$block" == auto ]] && block_flag=-1 || block_flag="$block"
  name="em-$model-$workload-b$block-g$budget-$pack-$optimizer"
  flags=(--config="qwen3-$model" --rollouts="$(workload_file "$workload")" --dtype=bfloat16
         --device=cuda --method=dta --block_size="$block_flag" --graph_budget="$budget"
         --pack="$pack" --lr=1e-6 --steps="$steps" --json --metrics="$out/$name.jsonl")
  [[ "$optimizer" == gpu ]] && flags+=(--offload_optimizer=false) || flags+=(--offload_optimizer=true)
  rm -f "$out/$name.jsonl"
  start=$(date +%s)
  status=0
  "$bin/dta-train" "${flags[@]}" >/dev/null 2>"$out/$name.log" || status=$?
  seconds=$(($(date +%s) - start))
  peak="$(python3 -c "import json,sys; l=[json.loads(x) for x in open(sys.argv[1]) if x.strip()]; print('%.3f' % l[-1]['peak_memory_gib'] if l else 'failed')" "$out/$name.jsonl" 2>/dev/null || echo failed)"
  planned="$(grep -h 'layout:' "$out/$name.log" | head -1 | sed 's/^dta-train: //')"
  ((status == 0)) || { tail -3 "$out/$name.log" >&2; planned="exit $status: $planned"; }
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$model" "$workload" "$block" "$budget" "$pack" \
    "$optimizer" "$peak" "$seconds" "$planned" | tee -a "$tsv" >&2
done
