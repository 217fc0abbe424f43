#!/usr/bin/env bash
# One H200: the final build, commit d4c2685 (the Hopper forward of ../after/, and the Python
# API's batch check and conversion in C++), only the Python extension and dta-workload built:
#  1. transformers' SDPA beside our dense and dta through the Python API on tau2 at scale 0.25;
#  2. bench/python_overhead.py on the same batch.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
out="${OUT:-/tmp/out}"; mkdir -p "$out"; start=$SECONDS
cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PWD/.deps/usr;$PWD/.deps/usr/lib/x86_64-linux-gnu/cmake" \
  -DDTA_PYTHON="$(command -v python3)" -DDTA_BUILD_BENCH=OFF -DDTA_BUILD_PYTHON=ON \
  -DDTA_BUILD_SERVICES=OFF >"$out/build.log" 2>&1 &&
  cmake --build build-device -j"$(nproc)" --target dta_python dta-workload >>"$out/build.log" 2>&1 ||
  { tail -30 "$out/build.log"; exit 1; }
site=build-device/site && rm -rf "$site" && mkdir -p "$site" && cp -r bindings/python/dta "$site/dta" &&
  cp build-device/python/dta/_core*.so "$site/dta/"
echo "built at $((SECONDS - start)) s"
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl 2>/dev/null
timeout 150 python3 bench/hf_baseline.py --rollouts=/tmp/tau2.jsonl --config=qwen3-1.7b --device=cuda \
  --dtype=bfloat16 --json --repeats=1 --methods=dta-pack,dta-dense,hf-sdpa >"$out/tau2.txt" 2>"$out/tau2.err"
echo "hf exit $? at $((SECONDS - start)) s"; grep -a "^hf_baseline" "$out/tau2.err"; grep -a -v '^{' "$out/tau2.txt"
timeout 60 python3 bench/python_overhead.py --rollouts=/tmp/tau2.jsonl >"$out/python_overhead.txt" 2>&1
echo "overhead exit $?"; cat "$out/python_overhead.txt"
echo "done at $((SECONDS - start)) s"
