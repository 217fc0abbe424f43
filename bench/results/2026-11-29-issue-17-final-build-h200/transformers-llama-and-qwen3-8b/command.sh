#!/usr/bin/env bash
# Issue 17's final build, third call (one H200, the same build plus bench/hf_baseline.py loading
# transformers' model of the config's family):
#  1. Llama-3.2-1B (32/8 heads of 64): transformers' SDPA (LlamaForCausalLM) beside our dense and
#     dta, tau2 at scale 0.25 with ids below Llama's vocabulary;
#  2. Qwen3-8B on tau2 at scale 0.2 (C = 7.92): dense-ckpt and dta-pack with dta-bench.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta_python dta-workload dta-bench"
source scripts/device_session.sh
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
mkdir -p "$out/all"
w=build-device/bin/dta-workload
$w --preset=tau2 --seed=1 --scale=0.25 --vocab_size=128256 --out=/tmp/tau2-llama.jsonl 2>/dev/null
$w --preset=tau2 --seed=1 --scale=0.2 --out=/tmp/tau2-s0.2.jsonl 2>/dev/null
timeout 170 python3 bench/hf_baseline.py --config=llama-3.2-1b --device=cuda --dtype=bfloat16 --json \
  --rollouts=/tmp/tau2-llama.jsonl --repeats=1 --methods=hf-sdpa,dta-dense,dta-pack \
  >"$out/all/llama-tau2.txt" 2>"$out/all/llama-tau2.err"
echo "llama exit $? at $((SECONDS - start)) s"
grep -a "^hf_baseline\|Error\|error" "$out/all/llama-tau2.err" | tail -6; grep -a -v '^{' "$out/all/llama-tau2.txt"
grep -a -o '"hf_class": "[A-Za-z0-9]*"' "$out/all/llama-tau2.txt"
timeout 200 build-device/bin/dta-bench --rollouts=/tmp/tau2-s0.2.jsonl --config=qwen3-8b --dtype=bfloat16 \
  --check=false --out_dir=/tmp/8b --repeats=1 --methods=dense-ckpt,dta-bauto-gauto-pack >"$out/all/8b.log" 2>&1
echo "8b exit $? at $((SECONDS - start)) s"; grep -a "^|" /tmp/8b/results.md | head -5
cp /tmp/8b/results.md "$out/all/8b.results.md"
(cd "$out" && tar czf all.tar.gz all && rm -rf all)
echo "done at $((SECONDS - start)) s"
