#!/usr/bin/env bash
# One H200: the final build, commit 0865d88 (first-kernels/'s, plus RMSNorm's forward and
# its backward's recomputation, and the q/k norm with RoPE each way, taking several rows per block
# or warp with their loads issued together)
#  1. the GPU tests: the kernels', the executor's (every family against dense in float64, bf16
#     agreement) and the Python trainer's;
#  2. dta-bench on tau2 at scale 0.25 (dense, dense-ckpt, dta) and a GPU-only profile of dta-pack;
#  3. dense against dta on GSM8K-like (scale 0.3) and AIME-like (4 rollouts of 16K) batches;
#  4. Qwen3-8B on tau2 at scale 0.2 (dense-ckpt, dta), if time is left.
# Logs under $OUT.
set -uo pipefail
source scripts/device_session.sh
for t in fused_layers_test gpu_equivalence_test hopper_tree_attention_test tree_attention_test chunk_attention_test; do
  timeout 100 build-device/tests/$t >"$out/$t.log" 2>&1
  echo "$t exit $?: $(grep -a -c -E '^\[       OK' "$out/$t.log") ok, $(grep -a -c -E '^\[  FAILED' "$out/$t.log") failed"
  grep -a -E "Failure" -A4 "$out/$t.log" | head -12
done
echo "kernel tests done at $((SECONDS - start)) s"
PYTHONPATH="$site:$PWD/tests/python" timeout 100 python3 -m pytest -q -s tests/python/test_trainer_gpu.py \
  >"$out/pytest.log" 2>&1
echo "pytest exit $?"; grep -a "bf16 median\|passed\|failed\|Error" "$out/pytest.log" | head -8
bench() {  # NAME LIMIT FLAGS...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" build-device/bin/dta-bench --dtype=bfloat16 --check=false --out_dir="/tmp/$name" "$@" \
    >"$out/$name.log" 2>&1
  echo "$name exit $? at $((SECONDS - start)) s"
  grep -a "^|" "/tmp/$name/results.md" | head -6; cp "/tmp/$name/results.md" "$out/$name.results.md"
}
w=build-device/bin/dta-workload
$w --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2-s0.25.jsonl 2>/dev/null
$w --preset=gsm8k --seed=1 --scale=0.3 --out=/tmp/gsm8k-s0.3.jsonl 2>/dev/null
$w --preset=aime --seed=1 --scale=0.1 --out=/tmp/aime-s0.1.jsonl 2>/dev/null
$w --preset=tau2 --seed=1 --scale=0.2 --out=/tmp/tau2-s0.2.jsonl 2>/dev/null
bench tau2 150 --rollouts=/tmp/tau2-s0.25.jsonl --config=qwen3-1.7b --repeats=2 \
  --methods=dense,dense-ckpt,dta-bauto-gauto-pack
PYTHONPATH="$site" timeout 80 python3 bench/hf_baseline.py --rollouts=/tmp/tau2-s0.25.jsonl \
  --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json --repeats=1 --methods=dta-pack \
  --profile --no-profile_host --profile_top=50 >"$out/profile.txt" 2>"$out/profile.err"
echo "profile exit $? at $((SECONDS - start)) s"
grep -a -v '^{' "$out/profile.txt" | grep -a -i "profile of\|RmsNorm\|LogitGrad\|busy\|cudaMemset"
bench gsm8k 60 --rollouts=/tmp/gsm8k-s0.3.jsonl --config=qwen3-1.7b --repeats=2 --methods=dense,dta-bauto-gauto-pack
bench aime-4 45 --rollouts=/tmp/aime-s0.1.jsonl --max_rollouts=4 --config=qwen3-1.7b --repeats=2 \
  --methods=dense,dta-bauto-gauto-pack
if ((SECONDS - start < 420)); then
  bench 8b 130 --rollouts=/tmp/tau2-s0.2.jsonl --config=qwen3-8b --repeats=1 --methods=dense-ckpt,dta-bauto-gauto-pack
fi
echo "done at $((SECONDS - start)) s"
