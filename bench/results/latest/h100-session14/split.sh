#!/usr/bin/env bash
# Session 14: kAuto splits long causal chains off any prefix (kernels/chunk_attention.h). Its GPU
# test, then dta against dense on the AIME-like batch and dta on tau2 (C = 8.35), each with the
# new default and with DTA_CUDNN_PREFIX=0 (the old default for these chunks), in one build.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
out="${OUT:-/tmp/out}"
mkdir -p "$out"
start=$SECONDS
timeout 280 scripts/device_build.sh -DDTA_BUILD_SERVICES=OFF >"$out/build.log" 2>&1 ||
  grep -q "No module named 'grpc_tools'" "$out/build.log" || { tail -30 "$out/build.log"; exit 1; }
echo "built at $((SECONDS - start)) s"
timeout 60 build-device/tests/chunk_attention_test >"$out/chunk_attention_test.log" 2>&1
echo "chunk_attention_test exit $?: $(grep -a -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/chunk_attention_test.log" | tr '\n' ' ')"
grep -a -E "Failure" -A3 "$out/chunk_attention_test.log" | head -12
bench() {  # NAME ROLLOUTS FLAGS...
  local name=$1 rollouts=$2
  shift 2
  timeout 80 build-device/bin/dta-bench --rollouts="$rollouts" --config=qwen3-1.7b --dtype=bfloat16 \
    --check=false --out_dir="$out/$name" "$@" >"$out/$name.log" 2>&1
  echo "$name exit $? at $((SECONDS - start)) s"
  grep -a "^| dta\|^| dense" "$out/$name/results.md" | cut -d'|' -f1-4,7,9
}
bench aime-split device-inputs/aime-s0.1.jsonl --repeats=2 --max_rollouts=4 --methods=dense,dta-bauto-gauto-pack
DTA_CUDNN_PREFIX=0 bench aime-tree device-inputs/aime-s0.1.jsonl --repeats=2 --max_rollouts=4 --methods=dta-bauto-gauto-pack
bench tau2-split device-inputs/tau2-s0.25.jsonl --repeats=2 --methods=dta-bauto-gauto-pack
DTA_CUDNN_PREFIX=0 bench tau2-tree device-inputs/tau2-s0.25.jsonl --repeats=2 --methods=dta-bauto-gauto-pack
echo "done at $((SECONDS - start)) s"
