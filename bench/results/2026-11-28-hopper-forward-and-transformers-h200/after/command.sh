#!/usr/bin/env bash
# One H200 (commit 7bdd7a1): the Hopper forward with its consumers' tile facts loaded a
# tile ahead and the mask's key_end loads issued together (../before/'s ncu profile is the before)
#  1. the GPU tests of the attention kernels, the executor's float64/bf16 equivalence and the
#     Python trainer's;
#  2. dta-attention-bench, and the same ncu profile as ../before/ of one forward launch (8K chain, 16/8);
#  3. dta-bench on tau2 at scale 0.25 (dense, dense-ckpt, dta).
set -uo pipefail
source scripts/device_session.sh
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
mkdir -p "$out/all"
for t in hopper_tree_attention_test tree_attention_test chunk_attention_test gpu_equivalence_test; do
  timeout 120 build-device/tests/$t >"$out/all/$t.log" 2>&1
  echo "$t exit $?: $(grep -a -c -E '^\[       OK' "$out/all/$t.log") ok, $(grep -a -c -E '^\[  FAILED' "$out/all/$t.log") failed"
  grep -a -E "Failure" -A4 "$out/all/$t.log" | head -12
done
echo "tests done at $((SECONDS - start)) s"
timeout 90 build-device/bin/dta-attention-bench >"$out/all/attention_bench.log" 2>&1
echo "attention bench exit $? at $((SECONDS - start)) s"
grep -a "^|" "$out/all/attention_bench.log" | grep -a "Hopper fwd + Hopper bwd\|flash" | head -12
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 90 "$ncu" --kernel-name regex:HopperForwardKernel --launch-skip 2 --launch-count 1 --set full \
  --import-source yes -o "$out/fwd" -f build-device/bin/dta-attention-bench --chain_case=1 --ours_only \
  --quick >"$out/all/ncu_run.log" 2>&1
echo "ncu exit $? at $((SECONDS - start)) s"
"$ncu" --import "$out/fwd.ncu-rep" --page details >"$out/all/fwd_details.txt" 2>&1
"$ncu" --import "$out/fwd.ncu-rep" --page source --csv --print-source sass >"$out/all/fwd_sass.csv" 2>&1
grep -a -i "Duration\|Warp Cycles Per Issued\|Compute (SM) Throughput\|Registers Per" "$out/all/fwd_details.txt" | head
rm -f "$out/fwd.ncu-rep"
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2-s0.25.jsonl 2>/dev/null
timeout 150 build-device/bin/dta-bench --rollouts=/tmp/tau2-s0.25.jsonl --config=qwen3-1.7b --dtype=bfloat16 \
  --check=false --out_dir=/tmp/tau2 --repeats=2 --methods=dense,dense-ckpt,dta-bauto-gauto-pack \
  >"$out/all/tau2.log" 2>&1
echo "tau2 exit $? at $((SECONDS - start)) s"; grep -a "^|" /tmp/tau2/results.md | head -6
cp /tmp/tau2/results.md "$out/all/tau2.results.md"
if ((SECONDS - start < 470)); then
  PYTHONPATH="$site:$PWD/tests/python" timeout $((560 - (SECONDS - start))) python3 -m pytest -q -s \
    tests/python/test_trainer_gpu.py >"$out/all/pytest.log" 2>&1
  echo "pytest exit $? at $((SECONDS - start)) s"; grep -a "bf16 median\|passed\|failed\|Error" "$out/all/pytest.log" | head -8
fi
(cd "$out" && tar czf all.tar.gz all && rm -rf all)
echo "done at $((SECONDS - start)) s"
