#!/usr/bin/env bash
# Runs named benchmark runs (bench/configs/) on a GPU machine and writes one dated record of them:
# the date, the device (nvidia-smi), the commit, the exact commands, each run's output (JSON, logs)
# and a README.md with the tables. Run from the repo root with .deps/ carried
# (scripts/device_deps.sh, run where apt works, fills it):
#
#   scripts/gpu_bench_set.sh [--out=DIR] [--topic=TOPIC] [--configs=DIR] [--no_build] [--dry_run]
#                            NAME...
#
#   NAME        bench/configs/NAME.set (config names, one a line) or bench/configs/NAME.flags (one
#               named run); several NAMEs run in the order given, each config once.
#   --configs   where the sets and runs are; default bench/configs (paths from the repo root).
#   --out       where the record goes; default bench/results (commit it there once it is back).
#   --topic     the record's name after the date; default the NAMEs joined by '+'.
#   --no_build  use the existing build-device/ binaries (and build-device/site for Python).
#   --dry_run   print the record's path and every command, run nothing (no GPU needed).
#
# A .flags file is a flag file as dta-bench's --flagfile reads it: one flag a line, '#' comments.
# Comment lines of the form '# key: value' say how to run it:
#   # tool: dta-bench (default), dta-attention-bench, hf_baseline (bench/hf_baseline.py, its flags
#           given one a line), or a script scripts/gpu_*.sh (its flags one a line; OUT is the run's
#           directory, --no_build is passed first)
#   # workload: dta-workload's flags for the rollouts (required by dta-bench and hf_baseline)
#   # first_rollouts: N   keep the workload's first N rollouts (dta-bench has --max_rollouts)
#   # env: VAR=VALUE ...  the run's environment
#   # timeout: SECONDS    the run's wall-clock limit (default 600)
#
# The record, DIR/<date>-<topic>-<device>/ (the UTC date; the device as nvidia-smi names it, e.g.
# h200, or 2xh200 for two):
#   README.md    date, device, host, commit, the commands and the tables, generated
#   record.json  the same facts and each run's exit status and seconds
#   commands.sh  every command as it ran, from the repo root
#   configs/     the .flags files as they ran
#   NAME/        each run's output: dta-bench's results.md, results.json and log.txt; hf_baseline's
#                results.jsonl (a JSON line per method) and log.txt; dta-attention-bench's
#                output.log; a script's own files and output.log
#   build.log
# A run that fails or times out is recorded with its exit status and the others go on; the script
# exits 1 if any did, 2 on bad arguments or configs (before anything runs).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

usage() { sed -n '2,39p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
fail() { echo "gpu_bench_set: $*" >&2; exit 2; }

configs_dir=bench/configs
out=bench/results
topic=""
build=1
dry_run=0
names=()
for arg in "$@"; do
  case "$arg" in
    --out=*) out="${arg#*=}" ;;
    --topic=*) topic="${arg#*=}" ;;
    --configs=*) configs_dir="${arg#*=}" ;;
    --no_build) build=0 ;;
    --dry_run) dry_run=1 ;;
    -h | --help) usage; exit 0 ;;
    -*) fail "unknown flag '$arg' (see --help)" ;;
    *) names+=("$arg") ;;
  esac
done
((${#names[@]})) || fail "no NAME given: a set or run of $configs_dir/ (see --help)"
[[ -n "$out" ]] || fail "--out is empty"
[[ -d "$configs_dir" ]] || fail "--configs: no directory '$configs_dir'"
[[ -z "$topic" ]] && topic="$(IFS=+; echo "${names[*]}")"
[[ "$topic" =~ ^[a-z0-9][a-z0-9.+_-]*$ ]] ||
  fail "--topic '$topic' must be lower-case letters, digits and . + _ - (it names a directory)"

# '# key: value' of a config (the first one), or empty.
directive() { sed -n "s/^#[[:space:]]*$2:[[:space:]]*//p" "$1" | head -1 | sed 's/[[:space:]]*$//'; }
# The flag lines of a config, comments and blank lines left out, one per line.
flag_lines() { sed -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' "$1" | grep -v -e '^#' -e '^$' || true; }

# Expands the NAMEs into config names (sets into their members), each once, in order.
runs=()
add_run() {
  local r
  for r in "${runs[@]+"${runs[@]}"}"; do [[ "$r" == "$1" ]] && return; done
  runs+=("$1")
}
for name in "${names[@]}"; do
  [[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || fail "'$name' is not a config name (letters, digits, . _ -)"
  if [[ -f "$configs_dir/$name.set" ]]; then
    mapfile -t members < <(flag_lines "$configs_dir/$name.set")
    ((${#members[@]})) || fail "$configs_dir/$name.set lists no runs"
    for m in "${members[@]}"; do
      [[ -f "$configs_dir/$m.flags" ]] ||
        fail "$configs_dir/$name.set: no run '$m' ($configs_dir/$m.flags is missing)"
      add_run "$m"
    done
  elif [[ -f "$configs_dir/$name.flags" ]]; then
    add_run "$name"
  else
    fail "no set or run '$name' (neither $configs_dir/$name.set nor $configs_dir/$name.flags)"
  fi
done

# Checks every config before anything runs; fills tool_of, workload_of, ... per run.
declare -A tool_of workload_of first_of env_of timeout_of
need_python=0 need_all=0 targets=()
add_target() {
  local t
  for t in "${targets[@]+"${targets[@]}"}"; do [[ "$t" == "$1" ]] && return; done
  targets+=("$1")
}
for r in "${runs[@]}"; do
  file="$configs_dir/$r.flags"
  tool="$(directive "$file" tool)"
  tool="${tool:-dta-bench}"
  workload="$(directive "$file" workload)"
  first="$(directive "$file" first_rollouts)"
  limit="$(directive "$file" timeout)"
  limit="${limit:-600}"
  [[ "$limit" =~ ^[1-9][0-9]*$ ]] || fail "$file: timeout '$limit' is not a number of seconds"
  [[ -z "$first" || "$first" =~ ^[1-9][0-9]*$ ]] ||
    fail "$file: first_rollouts '$first' is not a positive number"
  case "$tool" in
    dta-bench) add_target dta-bench; add_target dta-workload ;;
    hf_baseline) need_python=1; add_target dta_python; add_target dta-workload ;;
    dta-attention-bench) add_target dta-attention-bench ;;
    scripts/gpu_*.sh)
      [[ -x "$tool" ]] || fail "$file: tool $tool is not an executable script"
      need_all=1 ;;
    *) fail "$file: unknown tool '$tool' (dta-bench, dta-attention-bench, hf_baseline, scripts/gpu_*.sh)" ;;
  esac
  case "$tool" in
    dta-bench | hf_baseline)
      [[ -n "$workload" ]] || fail "$file: a $tool run needs a '# workload: ...' line" ;;
    *)
      [[ -z "$workload$first" ]] || fail "$file: $tool makes its own inputs: no workload or first_rollouts" ;;
  esac
  for kv in $(directive "$file" env); do
    [[ "$kv" =~ ^[A-Za-z_][A-Za-z0-9_]*=.*$ ]] || fail "$file: env '$kv' is not VAR=VALUE"
  done
  tool_of[$r]="$tool" workload_of[$r]="$workload" first_of[$r]="$first"
  env_of[$r]="$(directive "$file" env)" timeout_of[$r]="$limit"
done

# The device: nvidia-smi's first GPU, lower-case and without the vendor (h200), N x for N GPUs.
gpus=""
command -v nvidia-smi >/dev/null 2>&1 &&
  gpus="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true)"
if [[ -n "$gpus" ]]; then
  count="$(grep -c . <<<"$gpus")"
  device="$(head -1 <<<"$gpus" | cut -d, -f1 | tr '[:upper:]' '[:lower:]' |
    sed -e 's/^nvidia //' -e 's/ .*//' -e 's/[^a-z0-9]//g')"
  ((count == 1)) || device="${count}x$device"
elif ((dry_run)); then
  device="gpu"
else
  fail "nvidia-smi finds no GPU: run this on a GPU machine (or --dry_run)"
fi
date="$(date -u +%F)"
record="$out/$date-$topic-$device"
if [[ -e "$record" ]]; then
  n=2
  while [[ -e "$record-$n" ]]; do n=$((n + 1)); done
  record="$record-$n"
fi
commit="$(git rev-parse --short=7 HEAD 2>/dev/null || echo "${DTA_COMMIT:-unknown}")"
[[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null || true)" ]] || commit+=" with local changes"

export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$repo/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
bin="build-device/bin"
site="build-device/site"
work="${TMPDIR:-/tmp}/gpu_bench_set.$$"

# Runs (or with --dry_run prints) one command; its line goes to commands.sh. STDOUT and STDERR
# name where its output goes ('' leaves it on the terminal, '=' sends stderr to STDOUT's file).
status=0
run() {
  local stdout="$1" stderr="$2"
  shift 2
  local line="" word
  for word in "$@"; do
    # Words of plain characters as they are, others quoted for the shell.
    if [[ "$word" =~ ^[A-Za-z0-9_./=:,+@%*-]+$ ]]; then
      line+=" $word"
    else
      line+=" $(printf '%q' "$word")"
    fi
  done
  line="${line# }"
  [[ -z "$stdout" ]] || line+=" >$stdout"
  if [[ "$stderr" == "=" ]]; then line+=" 2>&1"; elif [[ -n "$stderr" ]]; then line+=" 2>$stderr"; fi
  if ((dry_run)); then echo "$line"; return 0; fi
  echo "$line" >>"$record/commands.sh"
  local rc=0
  (
    [[ -z "$stdout" ]] || exec >"$stdout"
    if [[ "$stderr" == "=" ]]; then exec 2>&1; elif [[ -n "$stderr" ]]; then exec 2>"$stderr"; fi
    exec "$@"
  ) || rc=$?
  return "$rc"
}

if ((dry_run)); then
  echo "record: $record (device from nvidia-smi; commit $commit)"
else
  mkdir -p "$record/configs" "$work"
  trap 'rm -rf "$work"' EXIT
  printf '#!/usr/bin/env bash\n# The commands of this record, as they ran from the repo root (%s).\n' \
    "$date" >"$record/commands.sh"
  for r in "${runs[@]}"; do cp "$configs_dir/$r.flags" "$record/configs/"; done
  echo "gpu_bench_set: $record" >&2
fi

if ((build)); then
  [[ -d .deps/usr ]] || ((dry_run)) ||
    fail ".deps/ is missing: run scripts/device_deps.sh where apt works and carry .deps"
  build_env=()
  ((need_all)) || build_env=(env DTA_DEVICE_TARGETS="${targets[*]}")
  cmake_flags=()
  ((need_python)) && cmake_flags=(-DDTA_BUILD_PYTHON=ON -DDTA_BUILD_SERVICES=OFF)
  start=$SECONDS
  # device_build.sh goes on past a failing target; the gRPC Python stubs fail where grpc_tools is
  # missing, and nothing here uses them.
  if ! run "$record/build.log" = "${build_env[@]+"${build_env[@]}"}" scripts/device_build.sh \
      "${cmake_flags[@]+"${cmake_flags[@]}"}" &&
      ! grep -q "No module named 'grpc_tools'" "$record/build.log"; then
    tail -30 "$record/build.log" >&2
    echo "gpu_bench_set: the build failed (see $record/build.log)" >&2
    exit 1
  fi
  ((dry_run)) || echo "gpu_bench_set: built in $((SECONDS - start)) s" >&2
fi
if ((need_python)); then
  run "" "" rm -rf "$site"
  run "" "" mkdir -p "$site"
  run "" "" cp -r bindings/python/dta "$site/dta"
  so=(build-device/python/dta/_core*.so)
  run "" "" cp "${so[@]}" "$site/dta/"
fi

# The rollouts of each distinct workload (WORKLOAD FLAGS, FIRST N), generated once: sets $rollouts.
declare -A workload_file
workload_for() {
  local base file
  base="$work/$(tr -c 'A-Za-z0-9.\n' '-' <<<"$1" | sed -e 's/-\{2,\}/-/g' -e 's/^-//' -e 's/-$//')"
  file="$base.jsonl"
  if [[ -z "${workload_file[$1|]:-}" ]]; then
    # shellcheck disable=SC2086  # the workload's flags, split on purpose
    run "" /dev/null "$bin/dta-workload" $1 --out="$file" || return 1
    workload_file[$1|]="$file"
  fi
  if [[ -n "$2" && -z "${workload_file[$1|$2]:-}" ]]; then
    run "$base-first$2.jsonl" "" head -n "$2" "$file" || return 1
    workload_file[$1|$2]="$base-first$2.jsonl"
  fi
  rollouts="${workload_file[$1|$2]}"
}

results="$work/runs.tsv"
((dry_run)) || : >"$results"
for r in "${runs[@]}"; do
  dir="$record/$r"
  ((dry_run)) || mkdir -p "$dir"
  config="$configs_dir/$r.flags"
  tool="${tool_of[$r]}"
  # shellcheck disable=SC2206  # VAR=VALUE words, split on purpose
  vars=(${env_of[$r]})
  envs=()  # 'env VAR=VALUE...' when the config sets any
  ((${#vars[@]} == 0)) || envs=(env "${vars[@]}")
  limit=(timeout "${timeout_of[$r]}")
  mapfile -t flags < <(flag_lines "$config")
  start=$SECONDS
  rc=0
  rollouts=""
  if [[ -n "${workload_of[$r]}" ]]; then
    workload_for "${workload_of[$r]}" "${first_of[$r]}" || rc=$?
  fi
  if ((rc == 0)); then
    case "$tool" in
      dta-bench)
        run /dev/null "$dir/log.txt" "${envs[@]+"${envs[@]}"}" "${limit[@]}" "$bin/dta-bench" \
          --flagfile="$config" --rollouts="$rollouts" --out_dir="$dir" --label="$r" || rc=$? ;;
      hf_baseline)
        run "$dir/results.jsonl" "$dir/log.txt" env "${vars[@]+"${vars[@]}"}" PYTHONPATH="$site" \
          "${limit[@]}" python3 bench/hf_baseline.py "${flags[@]+"${flags[@]}"}" --rollouts="$rollouts" \
          --json || rc=$? ;;
      dta-attention-bench)
        run "$dir/output.log" = "${envs[@]+"${envs[@]}"}" "${limit[@]}" "$bin/dta-attention-bench" \
          --flagfile="$config" || rc=$? ;;
      *)
        run "$dir/output.log" = env "${vars[@]+"${vars[@]}"}" OUT="$dir" "${limit[@]}" "$tool" --no_build \
          "${flags[@]+"${flags[@]}"}" || rc=$? ;;
    esac
  fi
  ((rc == 0)) || status=1
  if ((!dry_run)); then
    printf '%s\t%s\t%s\t%s\n' "$r" "$tool" "$rc" "$((SECONDS - start))" >>"$results"
    echo "gpu_bench_set: $r ($tool) exit $rc after $((SECONDS - start)) s" >&2
  fi
done
((dry_run)) && exit 0

# record.json and README.md, from what the runs left.
host="$(nproc) cores, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo) host memory"
python3 - "$record" "$results" "$date" "$topic" "$commit" "$host" "$gpus" "${names[*]}" "$configs_dir" <<'PY'
import json, pathlib, re, sys

record, results, date, topic, commit, host, gpus, names, configs = sys.argv[1:]
record = pathlib.Path(record)
runs = []
for line in pathlib.Path(results).read_text().splitlines():
    name, tool, rc, seconds = line.split("\t")
    runs.append({"name": name, "tool": tool, "exit_status": int(rc), "seconds": int(seconds)})
devices = [g.strip() for g in gpus.splitlines() if g.strip()]
meta = {"date": date, "topic": topic, "names": names.split(), "commit": commit, "gpus": devices,
        "host": host, "runs": runs}
(record / "record.json").write_text(json.dumps(meta, indent=2) + "\n")


def table_lines(path):
    return [l for l in path.read_text(errors="replace").splitlines() if l.startswith("|")]


def section(run):
    d = record / run["name"]
    out = [f"### {run['name']}", ""]
    config = (record / "configs" / f"{run['name']}.flags").read_text().splitlines()
    directive = re.compile(r"#\s*(tool|workload|first_rollouts|env|timeout):")
    out += [l.lstrip("#").strip() for l in config if l.startswith("#") and not directive.match(l)] + [""]
    if run["exit_status"] != 0:
        why = " (its time limit)" if run["exit_status"] == 124 else ""
        out += [f"Exited with status {run['exit_status']} after {run['seconds']} s{why}; "
                f"see `{run['name']}/`.", ""]
    if run["tool"] == "dta-bench" and (d / "results.md").exists():
        lines = (d / "results.md").read_text().splitlines()
        out += [l for l in lines if l.startswith(("- Workload", "- Ideal", "- Device"))] + [""]
        out += table_lines(d / "results.md")
    elif run["tool"] == "hf_baseline" and (d / "results.jsonl").exists():
        rows = [json.loads(l) for l in (d / "results.jsonl").read_text().splitlines() if l.startswith("{")]
        if rows:
            out += ["| method | seconds | rollout tok/s | vs the fastest dense "
                    "| inside the executor's call (s) |", "| --- | --- | --- | --- | --- |"]
        for r in rows:
            inside = f"{r['executor_seconds']:.3f}" if "executor_seconds" in r else ""
            out.append(f"| {r['method']} | {r['seconds']:.3f} | {r['rollout_tokens_per_second']:,.0f} | "
                       f"{r['vs_fastest_dense']:.2f}x | {inside} |")
    elif run["tool"] == "dta-attention-bench" and (d / "output.log").exists():
        out += table_lines(d / "output.log")
    else:
        for p in sorted(d.glob("*.md")):
            out += [f"`{p.name}`:", ""] + table_lines(p) + [""]
        for p in sorted(d.glob("*.tsv")):
            out += [f"`{p.name}`:", "", "```", p.read_text().rstrip(), "```", ""]
    return out + [""]


readme = [f"# {topic} ({date})", "",
          f"- Date: {date} (UTC)",
          f"- Device: {'; '.join(devices) or 'unknown'} "
          f"({len(devices)} GPU{'s' if len(devices) != 1 else ''})",
          f"- Host: {host}",
          f"- Commit: {commit}",
          f"- Runs: {', '.join(r['name'] for r in runs)} ({configs}/, copied into `configs/`)",
          "", "Generated by `scripts/gpu_bench_set.sh " + names + "`; each run's output is in its directory.",
          "", "## Commands", "", "```bash", (record / "commands.sh").read_text().rstrip(), "```", "",
          "## Results", ""]
for run in runs:
    readme += section(run)
(record / "README.md").write_text("\n".join(readme).rstrip() + "\n")
PY
echo "gpu_bench_set: done; the record is $record (README.md)" >&2
exit "$status"
