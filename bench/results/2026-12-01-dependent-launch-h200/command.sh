#!/usr/bin/env bash
# One H200, the build of the committed tree: the GPU tests of every kernel now launched after its
# predecessor, dta-bench on tau2 (Qwen3-1.7B twice each way, Qwen3-8B once) with
# DTA_DEPENDENT_LAUNCH=0 and 1, bench/step_gaps.py both ways. Logs under $OUT.
set -uo pipefail
tests="batched_copy_test chunk_attention_test chunk_state_recurrence_test fused_layers_test gated_delta_chunk_test head_norms_test hopper_tree_attention_test moe_router_test moe_rows_test tree_attention_test tree_causal_conv_test gpu_equivalence_test gated_delta_net_test qwen3_moe_test"
export DTA_DEVICE_TARGETS="dta_python dta-workload dta-bench $tests" DTA_DEVICE_BUILD_TIMEOUT=420
source scripts/device_session.sh
run_gtests $tests
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl 2>/dev/null
bench() {  # name config rollouts
  timeout 150 build-device/bin/dta-bench --rollouts=$3 --config=$2 --dtype=bfloat16 --check=false \
    --out_dir="$out/b-$1" --repeats=2 --methods=dta-bauto-gauto-pack >"$out/bench-$1.log" 2>&1
  echo "$1: $(grep -a '^| dta' "$out/b-$1/results.md" | cut -d'|' -f2-3,9)"
}
for i in 1 2; do
  DTA_DEPENDENT_LAUNCH=0 bench 1.7b-off-$i qwen3-1.7b /tmp/tau2.jsonl
  DTA_DEPENDENT_LAUNCH=1 bench 1.7b-on-$i qwen3-1.7b /tmp/tau2.jsonl
done
echo "1.7b benches at $((SECONDS - start)) s"
DTA_DEPENDENT_LAUNCH=0 bench 8b-off qwen3-8b /tmp/tau2-8b.jsonl
DTA_DEPENDENT_LAUNCH=1 bench 8b-on qwen3-8b /tmp/tau2-8b.jsonl
echo "8b benches at $((SECONDS - start)) s"
export PYTHONPATH="$site"
timeout 150 python3 bench/step_gaps.py --rollouts=/tmp/tau2.jsonl --config=qwen3-1.7b --top=12 > "$out/gaps-1.7b-on.txt" 2>&1
echo "gaps on exit $? at $((SECONDS - start)) s"; grep "GPU only\|GPU operations by kind" "$out/gaps-1.7b-on.txt"
DTA_DEPENDENT_LAUNCH=0 timeout 150 python3 bench/step_gaps.py --rollouts=/tmp/tau2.jsonl --config=qwen3-1.7b --top=12 > "$out/gaps-1.7b-off.txt" 2>&1
echo "gaps off exit $? at $((SECONDS - start)) s"; grep "GPU only\|GPU operations by kind" "$out/gaps-1.7b-off.txt"
