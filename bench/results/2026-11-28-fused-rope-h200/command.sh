#!/usr/bin/env bash
# Fused RoPE (one H200): RoPE without a q/k norm (Qwen2, Llama) in one kernel per
# direction (the q/k norm + RoPE kernels without the norm) instead of its ATen composition.
#  1. fused_layers_test (RoPE bitwise the CPU's), the executor's GPU equivalence (every family);
#  2. dta-bench on llama-3.2-1b, tau2 at scale 0.25 (ids below Llama's vocabulary), dta-pack,
#     DTA_FUSED_ROPE=0 and 1 in turn, twice.
set -uo pipefail
export DTA_DEVICE_TARGETS="dta-workload dta-bench fused_layers_test gpu_equivalence_test"
source scripts/device_session.sh
mkdir -p "$out/all"
run_gtests fused_layers_test gpu_equivalence_test
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --vocab_size=128256 \
  --out=/tmp/tau2-llama.jsonl 2>/dev/null
for round in 1 2; do
  for rope in 0 1; do
    DTA_FUSED_ROPE=$rope timeout 60 build-device/bin/dta-bench --rollouts=/tmp/tau2-llama.jsonl \
      --config=llama-3.2-1b --dtype=bfloat16 --check=false --out_dir=/tmp/l$rope$round --repeats=2 \
      --methods=dta-bauto-gauto-pack >"$out/all/llama_rope${rope}_$round.log" 2>&1
    echo "round $round rope=$rope exit $? at $((SECONDS - start)) s: $(grep -a '^| dta' /tmp/l$rope$round/results.md | cut -d'|' -f2,3,9)"
    cp /tmp/l$rope$round/results.md "$out/all/llama_rope${rope}_$round.results.md"
  done
done
(cd "$out" && tar czf all.tar.gz all && rm -rf all)
echo "done at $((SECONDS - start)) s"
