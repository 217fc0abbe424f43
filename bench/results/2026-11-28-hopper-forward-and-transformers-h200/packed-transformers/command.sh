#!/usr/bin/env bash
# One H200 (warm after ../after/, the same build): packed transformers on the
# GSM8K-like batch (scale 0.3), each with our dense beside it: SDPA on 16K packs ran out of memory
# (its dense [L, L] mask), flex attention on 16K packs padded to one shape did not finish in 170 s.
source scripts/device_session.sh; export PYTHONPATH="$site" PYTHONUNBUFFERED=1; build-device/bin/dta-workload --preset=gsm8k --seed=1 --scale=0.3 --out=/tmp/gsm8k.jsonl 2>/dev/null; for m in hf-sdpa-packed hf-flex-packed; do timeout 170 python3 bench/hf_baseline.py --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json --rollouts=/tmp/gsm8k.jsonl --repeats=2 --methods=$m,dta-dense >$out/gsm8k-$m.txt 2>$out/gsm8k-$m.err; echo "$m exit $? at $((SECONDS-start)) s"; grep -a "^hf_baseline\|Error" $out/gsm8k-$m.err | tail -4; grep -av '^{' $out/gsm8k-$m.txt; done
