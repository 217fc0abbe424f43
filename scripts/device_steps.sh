# The runs most device calls share, sourced by scripts/device_session.sh (which defines $out and
# $start and builds build-device/ first). Functions only; nothing runs when sourced.

# tau2_batches: the tau2-like batches of docs/benchmarks.md's step tables: /tmp/tau2.jsonl
# (Qwen3-1.7B's, scale 0.25) and /tmp/tau2-8b.jsonl (Qwen3-8B's, scale 0.101).
tau2_batches() {
  build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.25 --out=/tmp/tau2.jsonl >/dev/null 2>&1
  build-device/bin/dta-workload --preset=tau2 --seed=1 --scale=0.101 --out=/tmp/tau2-8b.jsonl >/dev/null 2>&1
}

# bench_step NAME CONFIG ROLLOUTS [FLAG...]: one dta-bench run of the executor's defaults
# (dta-bauto-gauto-pack, bf16, a warm-up and 2 timed steps, no agreement check; FLAGs are added or
# override), into /tmp/b-NAME with its log in /tmp/bench-NAME.log (copy what the record keeps to
# $out). Prints the exit status and the method, step time and MFU. Variables set on the call
# (DTA_X=0 bench_step ...) reach dta-bench.
bench_step() {
  local name=$1 config=$2 rollouts=$3
  shift 3
  timeout 150 build-device/bin/dta-bench --rollouts="$rollouts" --config="$config" --dtype=bfloat16 \
    --check=false --repeats=2 --methods=dta-bauto-gauto-pack --out_dir="/tmp/b-$name" "$@" \
    >"/tmp/bench-$name.log" 2>&1
  echo "$name exit $? at $((SECONDS - start)) s"
  grep -a '^| dta' "/tmp/b-$name/results.md" 2>/dev/null | cut -d'|' -f2-3,9
}
