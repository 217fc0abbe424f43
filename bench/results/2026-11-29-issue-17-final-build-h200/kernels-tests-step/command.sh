#!/usr/bin/env bash
# Issue 17's final build (commit 9ad9fa0) on one H200, the first of three device calls of it: the
# mixture-of-experts residual fusion and the EnvSwitchOn mend had run on no GPU yet.
#  1. the GPU tests: the attention kernels (both head dims), the fused layers, the executor's GPU
#     equivalence (every family, qwen3_moe's fused residual included), the Python trainer's;
#  2. dta-attention-bench at head dims 128 and 64;
#  3. dta-bench on tau2 at scale 0.25, qwen3-1.7b: dense, dense-ckpt, dta-pack.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta_python dta-workload dta-bench dta-attention-bench gpu_equivalence_test \
fused_layers_test hopper_tree_attention_test tree_attention_test chunk_attention_test"
source scripts/device_session.sh
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
mkdir -p "$out/all"
run_gtests hopper_tree_attention_test tree_attention_test chunk_attention_test fused_layers_test \
  gpu_equivalence_test
for d in 128 64; do
  timeout 90 build-device/bin/dta-attention-bench --head_dim=$d >"$out/all/attention_bench_d$d.log" 2>&1
  echo "attention bench D=$d exit $? at $((SECONDS - start)) s"
  grep -a "^|" "$out/all/attention_bench_d$d.log" | grep -a "Hopper fwd + Hopper bwd\|flash" | cut -d'|' -f2,3,6,9,10 | head -12
done
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
timeout 120 build-device/bin/dta-bench --rollouts=/tmp/tau2.jsonl --config=qwen3-1.7b --dtype=bfloat16 \
  --check=false --out_dir=/tmp/tau2 --repeats=2 --methods=dense,dense-ckpt,dta-bauto-gauto-pack \
  >"$out/all/tau2.log" 2>&1
echo "tau2 exit $? at $((SECONDS - start)) s"; grep -a "^|" /tmp/tau2/results.md | head -6
cp /tmp/tau2/results.md "$out/all/tau2.results.md"
if ((SECONDS - start < 480)); then
  PYTHONPATH="$site:$PWD/tests/python" timeout $((570 - (SECONDS - start))) python3 -m pytest -q -s \
    tests/python/test_trainer_gpu.py >"$out/all/pytest.log" 2>&1
  echo "pytest exit $? at $((SECONDS - start)) s"; grep -a "bf16 median\|passed\|failed\|Error" "$out/all/pytest.log" | head -8
fi
(cd "$out" && tar czf all.tar.gz all && rm -rf all)
echo "done at $((SECONDS - start)) s"
