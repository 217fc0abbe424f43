#!/usr/bin/env bash
# Issue 17's final build, second call (one H200, warm after kernels-tests-step/): Hugging Face transformers
# beside our dense and dta through the Python API (bench/hf_baseline.py), qwen3-1.7b, bf16, on
# the three batches of 2026-11-28: tau2 at scale 0.25 (C = 8.35), GSM8K-like at scale 0.3 (C = 1.10,
# transformers' SDPA on packs of 4,096 tokens as well), AIME-like 4 x 16K (C = 1.00).
set -uo pipefail
export DTA_DEVICE_TARGETS="dta_python dta-workload"
source scripts/device_session.sh
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
mkdir -p "$out/all"
w=build-device/bin/dta-workload
$w --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
$w --preset=gsm8k --seed=1 --scale=0.3 --out=/tmp/gsm8k.jsonl 2>/dev/null
$w --preset=aime --seed=1 --scale=0.1 --out=/tmp/aime.jsonl 2>/dev/null
head -4 /tmp/aime.jsonl >/tmp/aime-4.jsonl
hf() {  # NAME LIMIT FLAGS...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 bench/hf_baseline.py --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json \
    "$@" >"$out/all/$name.txt" 2>"$out/all/$name.err"
  echo "$name exit $? at $((SECONDS - start)) s"
  grep -a "^hf_baseline\|Error\|error" "$out/all/$name.err" | tail -6; grep -a -v '^{' "$out/all/$name.txt"
}
hf tau2 170 --rollouts=/tmp/tau2.jsonl --repeats=1 --methods=hf-sdpa,dta-dense,dta-pack
hf aime-4 120 --rollouts=/tmp/aime-4.jsonl --repeats=2 --methods=hf-sdpa,dta-dense,dta-pack
((SECONDS - start < 420)) &&
  hf gsm8k 150 --rollouts=/tmp/gsm8k.jsonl --repeats=2 --pack_tokens=4096 \
    --methods=hf-sdpa-packed,hf-sdpa,dta-dense,dta-pack
(cd "$out" && tar czf all.tar.gz all && rm -rf all)
echo "done at $((SECONDS - start)) s"
