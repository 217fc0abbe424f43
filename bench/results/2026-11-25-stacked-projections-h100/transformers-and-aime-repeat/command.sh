#!/usr/bin/env bash
# One H100, the last call of the stacked projections' build: transformers' SDPA beside dta with pack=True through the Python API on
# tau2 at scale 0.25, and the AIME-like batch again (three timed steps, with the B it ran with).
set -uo pipefail
source scripts/device_session.sh
PYTHONPATH="$site" timeout 120 python3 bench/hf_baseline.py --rollouts=device-inputs/tau2-s0.25.jsonl \
  --config=qwen3-1.7b --device=cuda --dtype=bfloat16 --json --repeats=2 --methods=hf-sdpa,dta-pack \
  >"$out/hf-s0.25.txt" 2>"$out/hf-s0.25.err"
echo "hf exit $? at $((SECONDS - start)) s"; grep -a "^hf_baseline" "$out/hf-s0.25.err"; grep -a -v '^{' "$out/hf-s0.25.txt"
timeout 100 build-device/bin/dta-bench --rollouts=device-inputs/aime-s0.1.jsonl --config=qwen3-1.7b \
  --dtype=bfloat16 --check=false --out_dir="$out/aime" --repeats=3 --max_rollouts=4 \
  --methods=dense,dta-bauto-gauto-pack >"$out/aime.log" 2>&1
echo "aime exit $? at $((SECONDS - start)) s"; grep -a "^|" "$out/aime/results.md" | head -5
python3 - "$out/aime/results.json" <<'PY'
import json, sys
def walk(x):
    if isinstance(x, dict):
        if "ran_with" in x:
            print(x.get("method") or x.get("name"), x["ran_with"], x.get("step_seconds"))
        for v in x.values(): walk(v)
    elif isinstance(x, list):
        for v in x: walk(v)
walk(json.load(open(sys.argv[1])))
PY
grep -a -i "ran with" "$out/aime/results.md" | head -3
echo "done at $((SECONDS - start)) s"
