#!/usr/bin/env bash
# One H200: the build of commit 9eb2f76 (../../2026-11-28-elementwise-kernels-h200/'s final kernels).
#  1. dta-attention-bench (all cases), then an ncu profile (full set, SASS-level source counters)
#     of one Hopper forward launch on the 8K chain with 16/8 heads: where the forward waits;
#  2. Hugging Face transformers beside our dense and dta through the Python API
#     (bench/hf_baseline.py), tau2 at scale 0.25 (C = 8.35) and AIME-like 4 x 16K (long sequences).
# Small outputs are bundled into $OUT/all.tar.gz (at most 8 files come back).
set -uo pipefail
source scripts/device_session.sh
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
w=build-device/bin/dta-workload
$w --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2-s0.25.jsonl 2>/dev/null
$w --preset=aime --seed=1 --scale=0.1 --out=/tmp/aime.jsonl 2>/dev/null
head -4 /tmp/aime.jsonl >/tmp/aime-4.jsonl  # dta-bench's --max_rollouts=4
mkdir -p "$out/all"
timeout 90 build-device/bin/dta-attention-bench >"$out/all/attention_bench.log" 2>&1
echo "attention bench exit $? at $((SECONDS - start)) s"
grep -a "^|" "$out/all/attention_bench.log" | grep -a "Hopper fwd + Hopper bwd\|flash" | head -12
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 120 "$ncu" --kernel-name regex:HopperForwardKernel --launch-skip 2 --launch-count 1 --set full \
  --import-source yes -o "$out/fwd" -f build-device/bin/dta-attention-bench --chain_case=1 --ours_only \
  --quick >"$out/all/ncu_run.log" 2>&1
echo "ncu exit $? at $((SECONDS - start)) s"; tail -3 "$out/all/ncu_run.log"
"$ncu" --import "$out/fwd.ncu-rep" --page details >"$out/all/fwd_details.txt" 2>&1
"$ncu" --import "$out/fwd.ncu-rep" --page source --csv --print-source sass >"$out/all/fwd_sass.csv" 2>&1
grep -a -i "Duration\|Warp Cycles Per Issued\|Issue Slots Busy\|Tensor\|Stall\|Registers Per\|Achieved Occ" \
  "$out/all/fwd_details.txt" | head -40
hf() {  # NAME LIMIT FLAGS...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 bench/hf_baseline.py --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json \
    "$@" >"$out/all/$name.txt" 2>"$out/all/$name.err"
  echo "$name exit $? at $((SECONDS - start)) s"
  grep -a "^hf_baseline\|Error\|error" "$out/all/$name.err" | tail -8; grep -a -v '^{' "$out/all/$name.txt"
}
hf tau2 170 --rollouts=/tmp/tau2-s0.25.jsonl --repeats=1 --methods=hf-sdpa,dta-dense,dta-pack
hf aime-4 120 --rollouts=/tmp/aime-4.jsonl --repeats=2 --methods=hf-sdpa,hf-flex,dta-dense,dta-pack
(cd "$out" && tar czf all.tar.gz all && rm -rf all)
echo "done at $((SECONDS - start)) s"
