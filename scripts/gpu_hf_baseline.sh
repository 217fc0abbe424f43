#!/usr/bin/env bash
# bench/hf_baseline.py on a GPU machine: builds the Python package (scripts/device_python.sh) and
# runs the script on each rollout file given, once as dta runs (fused layers, kernels/fused_layers.h,
# and cuDNN attention for chains, kernels/chain_attention.h) and once with DTA_FUSED_LAYERS=0
# DTA_CUDNN_ATTENTION=0 (ATen's layers, tree attention everywhere), so that both sit side by side with
# Hugging Face transformers on the same device, weights and rollouts. Output (tables, JSON lines,
# profiles) in ${OUT:-bench/results/gpu}/hf-baseline/.
#
#   scripts/gpu_hf_baseline.sh --rollouts=A.jsonl[,B.jsonl] [--config=qwen3-1.7b] [HF_BASELINE FLAGS...]
#   e.g. scripts/gpu_hf_baseline.sh --rollouts=tau2.jsonl --profile
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python="${DTA_PYTHON:-$(command -v python3)}"
rollouts=""
config="qwen3-1.7b"
flags=()
for arg in "$@"; do
  case "$arg" in
    --rollouts=*) rollouts="${arg#*=}" ;;
    --config=*) config="${arg#*=}" ;;
    *) flags+=("$arg") ;;
  esac
done
[[ -n "$rollouts" ]] || { sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }
export LD_LIBRARY_PATH="$repo/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
out="${OUT:-bench/results/gpu}/hf-baseline"
mkdir -p "$out"
start=$SECONDS
site="$(scripts/device_python.sh)"
echo "gpu_hf_baseline: built in $((SECONDS - start)) s"
IFS=',' read -ra files <<<"$rollouts"
for file in "${files[@]}"; do
  name="$(basename "$file" .jsonl)-$config"
  PYTHONPATH="$site" "$python" bench/hf_baseline.py --rollouts="$file" --config="$config" --device=cuda \
    --dtype=bfloat16 --json "${flags[@]}" | tee "$out/$name.txt"
  DTA_FUSED_LAYERS=0 DTA_CUDNN_ATTENTION=0 PYTHONPATH="$site" "$python" bench/hf_baseline.py --rollouts="$file" --config="$config" \
    --device=cuda --dtype=bfloat16 --json --methods=dta-dense,dta "${flags[@]}" | tee "$out/$name-unfused.txt"
done
