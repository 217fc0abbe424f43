#!/usr/bin/env bash
# One H200: the first kernels' build (the Hopper forward's work counter zeroed
# by the prepare kernel instead of a memset; RMSNorm's backward and weight gradient in one kernel;
# the logits' gradient vectorized)
#  1. the GPU tests of the kernels and the Python trainer (its bf16 check now on trajectories whose
#     PPO ratios keep off the clip edges), and which tokens cross a clip edge in bf16
#     (../test_diag_flips.py);
#  2. dta-bench on tau2 at scale 0.25 (dense, dense-ckpt, dta), a GPU-only profile of dta-pack
#     (before/'s is the before), the step's idle gaps and the callers of its memsets and adds;
#  3. dta-attention-bench.
# Logs under $OUT.
set -uo pipefail
source scripts/device_session.sh
for t in fused_layers_test hopper_tree_attention_test tree_attention_test chunk_attention_test; do
  timeout 120 build-device/tests/$t >"$out/$t.log" 2>&1
  echo "$t exit $?: $(grep -a -c -E '^\[       OK' "$out/$t.log") ok, $(grep -a -c -E '^\[  FAILED' "$out/$t.log") failed"
  grep -a -E "Failure" -A4 "$out/$t.log" | head -12
done
echo "kernel tests done at $((SECONDS - start)) s"
cp bench/results/2026-11-28-elementwise-kernels-h200/test_diag_flips.py tests/python/
export PYTHONPATH="$site:$PWD/tests/python"
timeout 150 python3 -m pytest -q -s tests/python/test_trainer_gpu.py tests/python/test_diag_flips.py \
  >"$out/pytest.log" 2>&1
echo "pytest exit $?"; grep -a "FLIPS\|bf16 median\|passed\|failed\|Error" "$out/pytest.log" | head -24
echo "pytest done at $((SECONDS - start)) s"
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2-s0.25.jsonl 2>/dev/null
timeout 150 build-device/bin/dta-bench --rollouts=/tmp/tau2-s0.25.jsonl --config=qwen3-1.7b \
  --dtype=bfloat16 --check=false --out_dir="$out/tau2" --repeats=2 \
  --methods=dense,dense-ckpt,dta-bauto-gauto-pack >"$out/tau2-s0.25.log" 2>&1
echo "tau2-s0.25 exit $? at $((SECONDS - start)) s"
grep -a "^|" "$out/tau2/results.md" | head -6; cp "$out/tau2/results.md" "$out/tau2-results.md"; rm -rf "$out/tau2"
timeout 100 python3 bench/hf_baseline.py --rollouts=/tmp/tau2-s0.25.jsonl \
  --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json --repeats=2 --methods=dta-pack \
  --profile --no-profile_host --profile_top=50 >"$out/profile.txt" 2>"$out/profile.err"
echo "profile exit $? at $((SECONDS - start)) s"
grep -a -v '^{' "$out/profile.txt" | grep -a -i "profile of\|RmsNorm\|LogitGrad\|Memset\|busy\|cudaMemset\|cudaLaunch"
timeout 90 python3 bench/results/2026-11-28-elementwise-kernels-h200/gaps.py --rollouts=/tmp/tau2-s0.25.jsonl >"$out/gaps.txt" 2>&1
echo "gaps exit $? at $((SECONDS - start)) s"; head -12 "$out/gaps.txt"
timeout 80 build-device/bin/dta-attention-bench >"$out/attention_bench.log" 2>&1
echo "attention bench exit $? at $((SECONDS - start)) s"
grep -a "^|" "$out/attention_bench.log" | grep -a "Hopper fwd + Hopper bwd\|flash" | head -12
echo "done at $((SECONDS - start)) s"
