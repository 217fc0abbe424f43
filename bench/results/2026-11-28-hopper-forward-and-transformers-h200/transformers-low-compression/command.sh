#!/usr/bin/env bash
# One H200 (warm after ../before/, the same build): transformers' SDPA beside our
# dense and dta through the Python API on the low-compression batches, AIME-like 4 x 16K (../before/'s
# attempt timed out in transformers' flex attention) and GSM8K-like (scale 0.3).
source scripts/device_session.sh; export PYTHONPATH="$site" PYTHONUNBUFFERED=1; w=build-device/bin/dta-workload; $w --preset=aime --seed=1 --scale=0.1 --out=/tmp/aime.jsonl 2>/dev/null; head -4 /tmp/aime.jsonl >/tmp/aime-4.jsonl; $w --preset=gsm8k --seed=1 --scale=0.3 --out=/tmp/gsm8k.jsonl 2>/dev/null; for x in aime-4 gsm8k; do timeout 200 python3 bench/hf_baseline.py --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json --rollouts=/tmp/$x.jsonl --repeats=2 --methods=hf-sdpa,dta-dense,dta-pack >$out/$x.txt 2>$out/$x.err; echo "$x exit $? at $((SECONDS-start)) s"; grep -a "^hf_baseline" $out/$x.err; grep -av '^{' $out/$x.txt; done
