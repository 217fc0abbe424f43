#!/usr/bin/env bash
# The GPU benchmark: dta-bench for every (model size, workload) asked for, then the plots.
# Run on a GPU machine from the repo root, with .deps/ carried (scripts/device_deps.sh, run where
# apt works, fills it):
#
#   scripts/gpu_bench.sh [--models=0.6b,1.7b,4b,8b] [--workloads=tau2,gsm8k,...] [--methods=...]
#                        [--token_budget=N] [--budget_factor=F] [--no_build] [--out=DIR]
#                        [DTA-BENCH FLAGS...]
#
#   --models        Qwen3 shapes (random weights): 0.6b, 1.7b, 4b, 8b. Default: all four. Other
#                   families by their dta-bench --config preset (qwen2.5-1.5b, llama-3.2-1b,
#                   llama-3.1-8b, qwen3-moe-small, qwen3-next-small), whose budget is 300K.
#   --workloads     dta-workload presets: tau2, gsm8k, aime, modified-prefix, branch-low,
#                   branch-mid, branch-high, long-agentic. Default: the first seven (tau2, gsm8k
#                   and aime are the papers' headline workloads; the others fill the compression
#                   curve, C 1.4 to 9); long-agentic's paths of 27K-51K tokens are asked by name.
#   --methods       passed to dta-bench (default: its own list, every method).
#   --token_budget  rollout tokens per step for every model, instead of the per-model defaults.
#   --budget_factor multiplies every budget (e.g. 0.5 when steps run slower than expected).
#   --no_build      use the existing build-device/ binaries.
#   --out           where results go; default ${OUT:-bench/results/gpu}.
#   Other --flags go to dta-bench as they are (e.g. --repeats=5, --peak_tflops=989, --check=false).
#   --tensor_parallel=N (N > 1) starts N ranks, one per GPU (NCCL), and writes to
#   DIR/qwen3-<model>-<workload>-tpN/, so that runs at several TP sizes sit side by side.
#
# Budget. Each workload is generated at the scale whose batch holds about the model's budget of
# rollout tokens, so that a dense step takes ~20 s on an H100 (dense fwd+bwd runs at roughly
# 25-40K rollout tokens/s on 1.7B and 6-8K on 8B): 0.6b 900K, 1.7b 600K, 4b 280K, 8b 140K.
# Workloads with C < 2.5 get half of it: there every method costs about as much as dense, so a
# sweep is ~24 dense-sized steps (6 methods x (1 warm-up + 3 timed)) instead of ~13. Either way
# one (model, workload) run is ~4-5 minutes: split the work over device calls of at most 10
# minutes (the first one also builds, about a minute), e.g.
#   scripts/gpu_bench.sh --models=1.7b --workloads=tau2,gsm8k
#   scripts/gpu_bench.sh --no_build --models=1.7b --workloads=aime,branch-mid
# --scale only multiplies the number of groups (tasks, prompts, trees), so C stays that of the
# preset, except for tau2, whose global system prompt is shared by fewer tasks in a smaller batch
# (C = 9.3 at scale 1, 8.9 at 0.5, 8.4 at 0.25, 7.4 at 0.1); every run reports the C it measured
# and the ideal speedup of that C. When one group alone is over 1.3x the budget (aime: 16
# rollouts of up to 16K tokens), the rollouts that fit are kept, from a group whose rewards differ
# and with both rewards in (a group with equal rewards has GRPO advantages 0, hence no gradient).
#
# Layout: DIR/<config>-<workload>/{results.md,results.json,log.txt} (e.g. qwen3-1.7b-tau2),
# DIR/workloads/*.jsonl, DIR/plots/*.png (bench/plot_bench.py over every results.json under DIR,
# when matplotlib is installed; otherwise run it where it is), DIR/summary.md (every results.md).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

usage() { sed -n '2,43p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

models="0.6b,1.7b,4b,8b"
workloads="tau2,gsm8k,aime,modified-prefix,branch-low,branch-mid,branch-high"
methods=""
token_budget=""
budget_factor=1
build=1
out="${OUT:-bench/results/gpu}"
bench_flags=()
tensor_parallel=1
for arg in "$@"; do
  case "$arg" in
    --models=*) models="${arg#*=}" ;;
    --workloads=*) workloads="${arg#*=}" ;;
    --methods=*) methods="${arg#*=}" ;;
    --token_budget=*) token_budget="${arg#*=}" ;;
    --budget_factor=*) budget_factor="${arg#*=}" ;;
    --no_build) build=0 ;;
    --out=*) out="${arg#*=}" ;;
    -h | --help) usage; exit 0 ;;
    --tensor_parallel=*) tensor_parallel="${arg#*=}"; bench_flags+=("$arg") ;;
    --*) bench_flags+=("$arg") ;;
    *) echo "gpu_bench: unexpected argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

IFS=',' read -r -a model_list <<<"$models"
IFS=',' read -r -a workload_list <<<"$workloads"
for m in "${model_list[@]}"; do
  case "$m" in
    0.6b | 1.7b | 4b | 8b | qwen2.5-1.5b | llama-3.2-1b | llama-3.1-8b | qwen3-moe-small | qwen3-next-small) ;;
    *) echo "gpu_bench: unknown model '$m' (0.6b, 1.7b, 4b, 8b, qwen2.5-1.5b, llama-3.2-1b, llama-3.1-8b," \
            "qwen3-moe-small, qwen3-next-small)" >&2
       exit 2 ;;
  esac
done
for w in "${workload_list[@]}"; do
  case "$w" in
    tau2 | gsm8k | aime | modified-prefix | branch-low | branch-mid | branch-high | long-agentic) ;;
    *) echo "gpu_bench: unknown workload '$w' (tau2, gsm8k, aime, modified-prefix, branch-low, branch-mid," \
            "branch-high, long-agentic)" >&2
       exit 2 ;;
  esac
done
[[ -z "$token_budget" || "$token_budget" =~ ^[0-9]+$ ]] || { echo "gpu_bench: --token_budget must be a number" >&2; exit 2; }
[[ "$budget_factor" =~ ^[0-9]*\.?[0-9]+$ ]] || { echo "gpu_bench: --budget_factor must be a number" >&2; exit 2; }
if [[ ! -d .deps/usr ]]; then
  echo "gpu_bench: .deps/ is missing: run scripts/device_deps.sh where apt works and carry .deps" >&2
  exit 2
fi

budget_for() {
  local tokens="$token_budget"
  if [[ -z "$tokens" ]]; then
    case "$1" in
      0.6b) tokens=900000 ;;
      1.7b) tokens=600000 ;;
      4b) tokens=280000 ;;
      8b) tokens=140000 ;;
      *) tokens=300000 ;;
    esac
  fi
  awk -v t="$tokens" -v f="$budget_factor" 'BEGIN { printf "%d\n", t * f }'
}

export LD_LIBRARY_PATH="$repo/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
bin="$repo/build-device/bin"
if ((build)); then
  echo "gpu_bench: building (scripts/device_build.sh)" >&2
  start=$SECONDS
  log="${TMPDIR:-/tmp}/gpu_bench_build.log"
  scripts/device_build.sh >"$log" 2>&1 || { tail -40 "$log" >&2; echo "gpu_bench: the build failed" >&2; exit 1; }
  echo "gpu_bench: built in $((SECONDS - start)) s" >&2
fi
for tool in dta-bench dta-workload dta-tree; do
  [[ -x "$bin/$tool" ]] || { echo "gpu_bench: $bin/$tool is missing (build first)" >&2; exit 1; }
done
python="$(command -v python3)"
mkdir -p "$out/workloads"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true

tree_stats() {  # FILE -> "rollouts rollout_tokens C"
  "$bin/dta-tree" --json "$1" | "$python" -c '
import json, sys
t = json.load(sys.stdin)["tree"]
print(t["rollouts"], t["rollout_tokens"], "%.3f" % t["compression"])'
}

# Writes the batch for (preset, budget) and prints "FILE SCALE KEPT": the preset at the scale
# whose batch holds about the budget (half of it when C < 2.5), and, when that batch is still over
# 1.3x that, the rollouts that fit (KEPT; 0 = all kept).
# The model's vocabulary when the workload's token ids must be drawn below Qwen's 151,936 (empty
# otherwise): dta-bench refuses ids outside the model's vocabulary.
vocab_for() {
  case "$1" in llama-*) echo 128256 ;; *) echo "" ;; esac
}

# VOCAB (third argument, may be empty): the workload is drawn with --vocab_size=VOCAB, its files
# named <preset>-vVOCAB-...
prepare() {
  local preset="$1" budget="$2" vocab="${3:-}"
  local name="$preset${vocab:+-v$vocab}" vocab_flag=()
  [[ -z "$vocab" ]] || vocab_flag=(--vocab_size="$vocab")
  local full="$out/workloads/$name-s1.jsonl"
  [[ -s "$full" ]] || "$bin/dta-workload" --preset="$preset" --seed=1 --scale=1 "${vocab_flag[@]}" --out="$full" >/dev/null
  local rollouts tokens c scale
  read -r rollouts tokens c <<<"$(tree_stats "$full")"
  read -r budget scale <<<"$("$python" -c '
import sys
budget, tokens, c = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
budget = budget if c >= 2.5 else budget / 2
print(int(budget), "%g" % float("%.2g" % min(1.0, budget / tokens)))' "$budget" "$tokens" "$c")"
  local file="$out/workloads/$name-s$scale.jsonl"
  [[ -s "$file" ]] || "$bin/dta-workload" --preset="$preset" --seed=1 --scale="$scale" "${vocab_flag[@]}" --out="$file" >/dev/null
  "$python" - "$file" "$budget" "$scale" <<'PY'
import json, sys
path, budget, scale = sys.argv[1], float(sys.argv[2]), sys.argv[3]
rows = [json.loads(line) for line in open(path) if line.strip()]
total = sum(len(r["tokens"]) for r in rows)
if total <= 1.3 * budget:
    print(path, scale, 0)
    sys.exit()
# Rollouts of the first group whose rewards differ come first (GRPO advantages of a group with
# equal rewards are 0), then the rest in file order, until the budget is reached.
groups = {}
for i, r in enumerate(rows):
    groups.setdefault(r["group"], []).append(i)
mixed = next((g for g in groups.values() if len({rows[i].get("reward") for i in g}) > 1), [])
order = mixed + [i for i in range(len(rows)) if i not in set(mixed)]
keep, tokens = [], 0
for i in order:
    if keep and tokens + len(rows[i]["tokens"]) > budget:
        break
    keep.append(i)
    tokens += len(rows[i]["tokens"])
# Both rewards of that group in the batch: swap its last kept rollout for one of the other reward.
kept_mixed = [i for i in keep if i in set(mixed)]
if len(kept_mixed) > 1 and len({rows[i].get("reward") for i in kept_mixed}) == 1:
    have = rows[kept_mixed[0]].get("reward")
    other = next(i for i in mixed if rows[i].get("reward") != have)
    keep[keep.index(kept_mixed[-1])] = other
keep.sort()
out = path[:-6] + "-n%d.jsonl" % len(keep)
with open(out, "w") as f:
    for i in keep:
        f.write(json.dumps(rows[i]) + "\n")
print(out, scale, len(keep))
PY
}

total_start=$SECONDS
for model in "${model_list[@]}"; do
  budget="$(budget_for "$model")"
  for preset in "${workload_list[@]}"; do
    vocab="$(vocab_for "$model")"
    read -r file scale kept <<<"$(prepare "$preset" "$budget" "$vocab")"
    read -r rollouts tokens c <<<"$(tree_stats "$file")"
    read -r _ _ c_full <<<"$(tree_stats "$out/workloads/$preset${vocab:+-v$vocab}-s1.jsonl")"
    subset=""
    ((kept == 0)) || subset=", $kept rollouts of it"
    config="$model"
    case "$model" in 0.6b | 1.7b | 4b | 8b) config="qwen3-$model" ;; esac
    run="$out/$config-$preset"
    ((tensor_parallel == 1)) || run+="-tp$tensor_parallel"
    mkdir -p "$run"
    echo "gpu_bench: $config on $preset: scale $scale$subset: $rollouts rollouts, $tokens rollout tokens," \
         "C = $c (scale 1: $c_full); elapsed $((SECONDS - total_start)) s" >&2
    # The papers' budgets: packed forwards of at most 24K unique tokens (Tree Training), 4K tokens
    # of kept graphs for dta's packed variants (dta-bench's own defaults are the executor's).
    args=(--rollouts="$file" --config="$config" --label="$preset" --out_dir="$run" --device=cuda
          --dtype=bfloat16 --token_capacity=24576 --graph_budget=4096)
    [[ -z "$methods" ]] || args+=(--methods="$methods")
    # stdout repeats results.md; progress (stderr) goes to the terminal and to log.txt.
    set +e
    if ((tensor_parallel == 1)); then
      "$bin/dta-bench" "${args[@]}" "${bench_flags[@]}" 2>&1 >/dev/null | tee "$run/log.txt" >&2
      status=${PIPESTATUS[0]}
    else
      # One rank per GPU; rank 0 reports (the others are quiet unless they fail).
      export NCCL_NVLS_ENABLE=0
      port=$((29000 + RANDOM % 1000))
      pids=()
      for ((rank = 1; rank < tensor_parallel; ++rank)); do
        RANK=$rank WORLD_SIZE=$tensor_parallel LOCAL_RANK=$rank LOCAL_WORLD_SIZE=$tensor_parallel \
          MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$bin/dta-bench" "${args[@]}" "${bench_flags[@]}" \
          >/dev/null 2>"$run/log.rank$rank.txt" &
        pids+=($!)
      done
      RANK=0 WORLD_SIZE=$tensor_parallel LOCAL_RANK=0 LOCAL_WORLD_SIZE=$tensor_parallel \
        MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$bin/dta-bench" "${args[@]}" "${bench_flags[@]}" \
        2>&1 >/dev/null | tee "$run/log.txt" >&2
      status=${PIPESTATUS[0]}
      for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    fi
    set -e
    if ((status == 2)); then
      echo "gpu_bench: dta-bench refused its input (see $run/log.txt)" >&2
      exit 2
    elif ((status != 0)); then
      echo "gpu_bench: dta-bench exited $status for $config on $preset; going on" >&2
    fi
  done
done

mapfile -t results < <(find "$out" -name results.json | sort)
{
  echo "# GPU benchmark"
  echo
  for r in "${results[@]}"; do
    cat "$(dirname "$r")/results.md"
    echo
  done
} >"$out/summary.md"
if ((${#results[@]})) && "$python" -c "import matplotlib" 2>/dev/null; then
  "$python" bench/plot_bench.py --out "$out/plots" "${results[@]}" >&2
else
  echo "gpu_bench: no plots here (matplotlib missing): python bench/plot_bench.py --out DIR $out/*/results.json" >&2
fi
echo "gpu_bench: done in $((SECONDS - total_start)) s; results in $out (summary.md)" >&2
