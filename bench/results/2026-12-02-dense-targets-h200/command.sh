#!/usr/bin/env bash
# Two calls on one H200 (the machine kept warm between them), commit 5b77de9 built there.
# ---- call 1
# One H200, from the repo root with .deps/ carried: issue 47's targets on the session's last build.
# Call 1: the build (with the Python package), the fused layers' and the GPU equivalence tests,
# then the tau2 steps beside our dense (1.7B: dense, dense-ckpt, dta; 8B: dense-ckpt, dta).
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench dta_python fused_layers_test gpu_equivalence_test" DTA_DEVICE_BUILD_TIMEOUT=360
source scripts/device_session.sh
run_gtests fused_layers_test gpu_equivalence_test
bin=build-device/bin
$bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
$bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
bench() {  # name config rollouts repeats methods
  timeout 200 $bin/dta-bench --rollouts=$3 --config=$2 --dtype=bfloat16 --check=false \
    --out_dir="/tmp/b-$1" --repeats=$4 --methods=$5 >"$out/bench-$1.log" 2>&1
  echo "$1 exit $? at $((SECONDS - start)) s"; grep -a '^| d' "/tmp/b-$1/results.md" | cut -d'|' -f2-3,5,7,9
}
bench tau2-1.7b qwen3-1.7b /tmp/tau2.jsonl 1 dense,dense-ckpt,dta-bauto-gauto-pack
bench tau2-8b qwen3-8b /tmp/tau2-8b.jsonl 1 dense-ckpt,dta-bauto-gauto-pack
echo "done at $((SECONDS - start)) s"

# ---- call 2
# Call 2 (the machine still warm: build-device/ kept, the build a no-op): Qwen3-8B on paths to 44K
# tokens, and transformers' SDPA beside our dense and dta through the Python API
# (bench/hf_baseline.py) on the 1.7B and 8B tau2 batches.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench dta_python" DTA_DEVICE_BUILD_TIMEOUT=120
source scripts/device_session.sh
bin=build-device/bin
$bin/dta-workload --preset=long-agentic --seed=1 --scale=0.25 --out=/tmp/long.jsonl 2>/dev/null
$bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
$bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
timeout 150 $bin/dta-bench --rollouts=/tmp/long.jsonl --config=qwen3-8b --dtype=bfloat16 --check=false \
  --out_dir=/tmp/b-long-8b --repeats=1 --methods=dta-bauto-gauto-pack >"$out/bench-long-8b.log" 2>&1
echo "long-8b exit $? at $((SECONDS - start)) s"; grep -a '^| d' /tmp/b-long-8b/results.md | cut -d'|' -f2-3,7,9
hf() {  # name config rollouts methods
  PYTHONPATH=$site timeout 200 python3 bench/hf_baseline.py --rollouts=$3 --config=$2 --device=cuda \
    --dtype=bfloat16 --repeats=1 --methods=$4 > "$out/hf-$1.log" 2>&1
  echo "hf-$1 exit $? at $((SECONDS - start)) s"; grep -a "^|" "$out/hf-$1.log" | tail -6
}
hf tau2-1.7b qwen3-1.7b /tmp/tau2.jsonl hf-sdpa,dta-dense,dta-pack
hf tau2-8b qwen3-8b /tmp/tau2-8b.jsonl hf-sdpa,dta-pack
echo "done at $((SECONDS - start)) s"
