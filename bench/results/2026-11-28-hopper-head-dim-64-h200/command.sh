#!/usr/bin/env bash
# One H200: the Hopper tree-attention kernels at head dim 64.
#  1. the GPU tests of the attention kernels (hopper_tree_attention_test now runs D = 64 too) and
#     the executor's GPU equivalence (its bf16 model has head dim 64, so dta's step now runs the
#     Hopper kernels there);
#  2. dta-attention-bench at head dim 64, then at 128 (no regression);
#  3. dta-bench on llama-3.2-1b (32/8 heads of 64), tau2 at scale 0.25, dta-pack with the
#     FlashAttention-2 kernels (DTA_HOPPER_ATTENTION*=0) and with the Hopper ones.
set -uo pipefail
source scripts/device_session.sh
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
mkdir -p "$out/all"
run_gtests hopper_tree_attention_test tree_attention_test chunk_attention_test gpu_equivalence_test
grep -a "D=64" "$out/all/hopper_tree_attention_test.log" | cut -c1-200 | head -14
for d in 64 128; do
  timeout 100 build-device/bin/dta-attention-bench --head_dim=$d >"$out/all/attention_bench_d$d.log" 2>&1
  echo "attention bench D=$d exit $? at $((SECONDS - start)) s"
  grep -a "^|" "$out/all/attention_bench_d$d.log" | grep -a "Hopper fwd + Hopper bwd\|flash\|FA2" | cut -d'|' -f2,3,6,9,10 | head -16
done
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --vocab_size=128256 \
  --out=/tmp/tau2-llama.jsonl 2>/dev/null
for hopper in 0 1; do
  ((SECONDS - start > 480)) && break
  DTA_HOPPER_ATTENTION=$hopper DTA_HOPPER_ATTENTION_BACKWARD=$hopper timeout 110 \
    build-device/bin/dta-bench --rollouts=/tmp/tau2-llama.jsonl --config=llama-3.2-1b \
    --dtype=bfloat16 --check=false --out_dir=/tmp/llama$hopper --repeats=2 \
    --methods=dta-bauto-gauto-pack >"$out/all/llama_hopper$hopper.log" 2>&1
  echo "llama-3.2-1b hopper=$hopper exit $? at $((SECONDS - start)) s"
  grep -a "^|" /tmp/llama$hopper/results.md | head -4
  cp /tmp/llama$hopper/results.md "$out/all/llama_hopper$hopper.results.md"
done
(cd "$out" && tar czf all.tar.gz all && rm -rf all)
echo "done at $((SECONDS - start)) s"
