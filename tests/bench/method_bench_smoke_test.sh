#!/usr/bin/env bash
# Smoke test of dta-bench on the CPU: a tiny Qwen3 in float32 on three generated rollouts, two
# methods (dense and dta); results.md and results.json must exist and name both methods, the
# agreement check must agree to float32 rounding, bad input must exit 2 naming what is wrong,
# --profile must write each method's profile, and bench/plot_bench.py must draw the results when
# matplotlib is there.
# Usage: method_bench_smoke_test.sh BIN_DIR PYTHON SOURCE_DIR
set -uo pipefail
bin="$1"
python="$2"
src="$3"
source "$(dirname "${BASH_SOURCE[0]}")/../shell_checks.sh"

# One thread: the test is tiny and CTest runs others beside it.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# Three rollouts of one modified-prefix task (about 6K rollout tokens; two share a task prompt).
"$bin/dta-workload" --preset=modified-prefix --seed=1 --scale=0.01 --vocab_size=1024 --out="$work/all.jsonl" \
  2>/dev/null || fail "dta-workload exited $?"
head -n 3 "$work/all.jsonl" >"$work/small.jsonl"

tiny="$src/examples/configs/qwen3-tiny.json"
"$bin/dta-bench" --rollouts="$work/small.jsonl" --config="$tiny" --check_config="$tiny" --device=cpu \
  --dtype=float32 --methods=dense,dta-b2048 --warmup=1 --repeats=1 --check_rollouts=2 \
  --out_dir="$work/out" >"$work/stdout.txt" 2>"$work/stderr.txt"
status=$?
[[ $status -eq 0 ]] || fail "dta-bench exited $status: $(tail -5 "$work/stderr.txt")"
for file in results.md results.json; do
  [[ -s "$work/out/$file" ]] || fail "$file is missing or empty"
done
for method in dense dta-b2048; do
  grep -qF "| $method |" "$work/out/results.md" || fail "results.md has no row for $method"
done
grep -qF "## Agreement check" "$work/out/results.md" || fail "results.md has no agreement check"
grep -qF "step 1/1" "$work/stderr.txt" || fail "no progress lines on stderr"

"$python" - "$work/out/results.json" <<'PY' || fail "results.json is wrong"
import json, sys
out = json.load(open(sys.argv[1]))
methods = {m["name"]: m for m in out["methods"]}
assert set(methods) == {"dense", "dta-b2048"}, methods.keys()
w = out["workload"]
assert w["rollouts"] == 3 and w["unique_tokens"] < w["rollout_tokens"], w
assert abs(w["compression"] - w["rollout_tokens"] / w["unique_tokens"]) < 1e-9
for name, m in methods.items():
    assert m["status"] == "ok", (name, m["status"], m["note"])
    assert len(m["step_seconds"]) == 1 and len(m["warmup_seconds"]) == 1
    assert m["rollout_tokens_per_second"] > 0 and m["peak_memory_gib"] > 0
    assert m["mfu"] is None  # no MFU on the CPU
    # Same loss for every method (float32 rounding).
    assert abs(m["loss"] - methods["dense"]["loss"]) <= 1e-4 * abs(methods["dense"]["loss"]), name
assert methods["dense"]["speedup_vs_dense"] == 1.0
assert m["options"]["logprob_slice_rows"] == 512, m["options"]  # the executor's default
# A name without -pack runs without packing, although the executor packs by default.
assert methods["dta-b2048"]["options"]["pack"] is False, methods["dta-b2048"]["options"]
assert out["flops"]["ideal_speedup_vs_dense"] > 1
assert out["dtype"] == "float32" and out["torch_version"] and "dta-bench" in out["command"]
check = out["check"]
rows = {r["method"]: r for r in check["rows"]}
assert set(rows) == {"dense", "dta-b2048"}, rows.keys()
for name, r in rows.items():
    assert r["status"] == "ok", (name, r)
    # float32 against the float32 reference: rounding only.
    assert r["vs_reference"]["median_param_rel_err"] < 1e-4, (name, r)
    assert r["vs_reference"]["grad_rel_err"] < 1e-4, (name, r)
PY

# -mhalf: a dta variant under half of dense's measured peak (the CPU ignores the budget, but the
# run records it and the chunk sizes the step ran with).
"$bin/dta-bench" --rollouts="$work/small.jsonl" --config="$tiny" --device=cpu --dtype=float32 \
  --methods=dense,dta-bauto-mhalf --check=false --warmup=0 --repeats=1 --out_dir="$work/half" \
  >/dev/null 2>"$work/half.err" || fail "dta-bench -mhalf exited $?: $(tail -5 "$work/half.err")"
"$python" - "$work/half/results.json" <<'PY' || fail "the -mhalf results are wrong"
import json, sys
methods = {m["name"]: m for m in json.load(open(sys.argv[1]))["methods"]}
dense, half = methods["dense"], methods["dta-bauto-mhalf"]
assert half["status"] == "ok", half
budget = half["options"]["memory_budget_gib"]
assert abs(budget - dense["peak_memory_gib"] / 2) <= 1e-6 * dense["peak_memory_gib"], (budget, dense)
assert half["ran_with"]["block_size"] > 0, half
assert "GiB budget" in half["note"], half["note"]
PY
grep -qF "dta-bauto-mhalf: ok:" "$work/half/results.md" || fail "results.md does not note the budget"
# results.md says what the automatic sizes resolved to and how many tokens went through the model,
# the numbers of the JSON.
"$python" - "$work/half/results.json" "$work/half/results.md" <<'PY' || fail "results.md's chunk line is wrong"
import json, sys
out = json.load(open(sys.argv[1]))
half = {m["name"]: m for m in out["methods"]}["dta-bauto-mhalf"]
unique = out["workload"]["unique_tokens"]
line = (f"- dta-bauto-mhalf ran with B = {half['ran_with']['block_size']:,} tokens and a graph budget of "
        f"{half['ran_with']['graph_budget']:,}; it forwarded {half['forwarded_tokens']:,} tokens, "
        f"{half['forwarded_tokens'] / unique:.2f}x the {unique:,} unique.")
assert line in open(sys.argv[2]).read(), line
PY

# Tensor parallelism: two ranks on Gloo, as torchrun starts them. The same seed is the same model at
# every TP size, so each method's loss equals the one-process run's; rank 0 alone writes results.
port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
pids=()
for rank in 0 1; do
  RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
    "$bin/dta-bench" --rollouts="$work/small.jsonl" --config="$tiny" --check_config="$tiny" --device=cpu \
    --dtype=float32 --methods=dense,dta-b2048 --warmup=1 --repeats=1 --check_rollouts=2 --tensor_parallel=2 \
    --timeout_s=120 --out_dir="$work/tp2" >"$work/tp2.$rank.out" 2>"$work/tp2.$rank.err" &
  pids+=($!)
done
for rank in 0 1; do
  wait "${pids[$rank]}" || fail "dta-bench --tensor_parallel=2 rank $rank exited $?: $(tail -5 "$work/tp2.$rank.err")"
done
[[ -s "$work/tp2.1.err" ]] && fail "rank 1 printed progress: $(head -3 "$work/tp2.1.err")"
"$python" - "$work/out/results.json" "$work/tp2/results.json" <<'PY' || fail "the TP 2 results are wrong"
import json, sys
one, two = (json.load(open(path)) for path in sys.argv[1:])
assert two["tensor_parallel"] == 2 and one["tensor_parallel"] == 1
losses = {m["name"]: m["loss"] for m in one["methods"]}
for m in two["methods"]:
    assert m["status"] == "ok", (m["name"], m["note"])
    assert abs(m["loss"] - losses[m["name"]]) <= 1e-5 * abs(losses[m["name"]]), (m["name"], m["loss"], losses)
assert two["check"]["passed"], two["check"]
PY
expect_tp() {
  RANK=0 WORLD_SIZE=1 "$bin/dta-bench" --rollouts="$work/small.jsonl" --config="$tiny" --device=cpu \
    --tensor_parallel=2 --out_dir="$work/bad" >/dev/null 2>"$work/tp_bad.err"
  local s=$?
  [[ $s -eq 2 ]] || fail "--tensor_parallel=2 with one rank exited $s, expected 2"
  grep -qF "start exactly 2 ranks" "$work/tp_bad.err" || fail "the TP refusal: $(cat "$work/tp_bad.err")"
}
expect_tp

# Bad input: exit status 2 and a message naming the problem.
expect_bad() {
  local what="$1" pattern="$2"
  shift 2
  "$bin/dta-bench" "$@" --device=cpu --dtype=float32 --out_dir="$work/bad" >/dev/null 2>"$work/bad.err"
  local s=$?
  [[ $s -eq 2 ]] || fail "$what exited $s, expected 2"
  grep -qF -- "$pattern" "$work/bad.err" || fail "$what: message lacks '$pattern': $(cat "$work/bad.err")"
}
printf '%s\n' '{"id": "a", "group": "g", "tokens": [1, 5000], "loss_mask": [0, 1], "logprobs": [0, -1], "reward": 1}' \
  >"$work/big_token.jsonl"
expect_bad "a missing file" "missing.jsonl" --rollouts="$work/missing.jsonl" --config="$tiny"
expect_bad "an unknown method" "unknown method 'nope'" --rollouts="$work/small.jsonl" --config="$tiny" --methods=dense,nope
expect_bad "a bad dta variant" "dta-bx" --rollouts="$work/small.jsonl" --config="$tiny" --methods=dta-bx
expect_bad "a zero memory budget" "-m<GiB>|-mhalf" --rollouts="$work/small.jsonl" --config="$tiny" \
  --methods=dta-b64-m0
expect_bad "a bad config" "--config=qwen3-nope" --rollouts="$work/small.jsonl" --config=qwen3-nope
expect_bad "no profile rows" "--profile_top must be >= 1" --rollouts="$work/small.jsonl" --config="$tiny" \
  --profile --profile_top=0
expect_bad "no logprob rows" "--logprob_slice_rows must be >= 1" --rollouts="$work/small.jsonl" \
  --config="$tiny" --logprob_slice_rows=0
expect_bad "a token beyond the vocabulary" "big_token.jsonl:1" --rollouts="$work/big_token.jsonl" --config="$tiny"

# --logprob_slice_rows: the LM head's slices of rows (the same loss), recorded with the options.
"$bin/dta-bench" --rollouts="$work/small.jsonl" --config="$tiny" --device=cpu --dtype=float32 \
  --methods=dense --warmup=0 --repeats=1 --check=false --logprob_slice_rows=3 \
  --out_dir="$work/slices" >/dev/null 2>"$work/slices.err" || fail "dta-bench --logprob_slice_rows exited $?"
"$python" - "$work/out/results.json" "$work/slices/results.json" <<'PY' || fail "--logprob_slice_rows: wrong results"
import json, sys
default, sliced = (json.load(open(path))["methods"][0] for path in sys.argv[1:])
assert sliced["options"]["logprob_slice_rows"] == 3, sliced["options"]
assert abs(sliced["loss"] - default["loss"]) <= 1e-5 * abs(default["loss"]), (sliced["loss"], default["loss"])
PY

# --profile: one more step of each method under the profiler, its operators by time in a file.
"$bin/dta-bench" --rollouts="$work/small.jsonl" --config="$tiny" --device=cpu --dtype=float32 \
  --methods=dense --warmup=0 --repeats=1 --check=false --profile --profile_top=5 \
  --out_dir="$work/profiled" >/dev/null 2>"$work/profiled.err" || fail "dta-bench --profile exited $?"
profile="$work/profiled/profile-dense.md"
grep -qF "| ms | share | calls | name |" "$profile" 2>/dev/null || fail "no profile table in $profile"
rows=$(grep -c '^| [0-9.]* | [0-9.]*% | [0-9]* | `aten::' "$profile" 2>/dev/null)
[[ "$rows" -ge 1 && "$rows" -le 5 ]] || fail "profile-dense.md has $rows aten rows (want 1 to 5)"
grep -qF "dense: profiled step" "$work/profiled.err" || fail "no progress line for the profiled step"

if "$python" -c "import matplotlib" 2>/dev/null; then
  "$python" "$src/bench/plot_bench.py" --out "$work/plots" "$work/out/results.json" >"$work/plots.txt" 2>&1 ||
    fail "plot_bench.py exited $?: $(tail -3 "$work/plots.txt")"
  ls "$work/plots"/throughput_small.png "$work/plots"/memory_small.png >/dev/null 2>&1 || fail "plot_bench.py drew no PNGs"
fi

if ((failures)); then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all dta-bench checks passed"
