#!/usr/bin/env bash
# End-to-end checks of the command-line tools: dta-workload writes a file, dta-tree reads it
# (tables and JSON), bad input gets exit status 2 with a message naming file, line and field, and
# --help on every binary lists its own flags.
# Usage: cli_test.sh BIN_DIR PYTHON
set -uo pipefail
bin="$1"
python="$2"
source "$(dirname "${BASH_SOURCE[0]}")/../shell_checks.sh"

"$bin/dta-workload" --preset=tau2 --seed=3 --out="$work/tau2.jsonl" 2>"$work/gen.err" || fail "dta-workload exited $?"
[[ -s "$work/tau2.jsonl" ]] || fail "dta-workload wrote nothing"

"$bin/dta-tree" --block_size=2048 --partitions=4 "$work/tau2.jsonl" >"$work/table.txt" || fail "dta-tree exited $?"
for expected in "compression C" "leaf-only C" "POR" "C_attn" "Push/pop schedule (B = 2,048" \
                "dfs-contiguous (Algorithm 4)" "greedy by rollout tokens" "greedy by tree tokens" \
                "ERR (redundancy removed)"; do
  grep -qF "$expected" "$work/table.txt" || fail "table lacks '$expected'"
done

"$bin/dta-tree" --json --partitions=4 --order=lexicographic "$work/tau2.jsonl" >"$work/out.json" || fail "dta-tree --json exited $?"
"$python" - "$work/out.json" <<'PY' || fail "JSON output is wrong"
import json, sys
out = json.load(open(sys.argv[1]))
tree, schedule, partition = out["tree"], out["schedule"], out["partition"]
assert tree["rollouts"] > 0 and tree["tree_tokens"] <= tree["rollout_tokens"]
assert abs(tree["compression"] - tree["rollout_tokens"] / tree["tree_tokens"]) < 1e-9
assert schedule["order"] == "lexicographic" and schedule["largest_backward"] <= 2048
assert partition["ranks"] == 4 and len(partition["dfs_contiguous"]["cost"]) == 4
ours = partition["dfs_contiguous"]["max_cost"]
assert ours <= partition["greedy_rollout_tokens"]["max_cost"], "Algorithm 4 lost to the rollout-token baseline"
packed = out["packed_tree"]
assert tree["tree_tokens"] <= packed["total_tokens"] <= packed["flattened_tokens"]
assert 0 <= packed["effective_reuse_ratio"] <= 1
PY

# Bad input: the second line's loss_mask is one value short.
printf '%s\n%s\n' \
  '{"id": "a", "group": "g", "tokens": [1, 2], "loss_mask": [0, 1], "logprobs": [0, -1]}' \
  '{"id": "b", "group": "g", "tokens": [1, 2], "loss_mask": [0], "logprobs": [0, -1]}' >"$work/bad.jsonl"
"$bin/dta-tree" "$work/bad.jsonl" >/dev/null 2>"$work/bad.err"
status=$?
[[ $status -eq 2 ]] || fail "bad input exited $status, expected 2"
grep -qF "$work/bad.jsonl:2: rollout 'b': field 'loss_mask'" "$work/bad.err" || fail "bad input message: $(cat "$work/bad.err")"

"$bin/dta-tree" "$work/missing.jsonl" >/dev/null 2>&1
[[ $? -eq 2 ]] || fail "a missing file must exit 2"
"$bin/dta-tree" --order=random "$work/tau2.jsonl" >/dev/null 2>&1
[[ $? -eq 2 ]] || fail "a bad --order must exit 2"
"$bin/dta-workload" --preset=nope --out="$work/x.jsonl" >/dev/null 2>&1
[[ $? -eq 2 ]] || fail "an unknown preset must exit 2"

# --help lists each binary's own flags (Abseil's default lists only flags of a file named after
# the binary, and printed "No flags matched" for all of ours). Binaries that need LibTorch or gRPC
# are checked where they were built; dta-tree and dta-workload are always built.
for pair in dta-tree:--partitions dta-workload:--preset dta-layout:--world_size dta-train:--block_size dta-trainer:--checkpoint_dir \
            dta-dispatcher:--wal dta-send:--rollouts dta-bench:--methods dta-ingest-bench:--streams \
            dta-attention-bench:--ours_only; do
  binary="${pair%%:*}"
  expected="${pair#*:}"
  if [[ ! -x "$bin/$binary" ]]; then
    [[ "$binary" != dta-tree && "$binary" != dta-workload && "$binary" != dta-layout ]] || fail "$bin/$binary is missing"
    continue
  fi
  "$bin/$binary" --help >"$work/help.txt" 2>&1
  grep -qF -- "$expected" "$work/help.txt" || fail "$binary --help does not list $expected: $(head -c 300 "$work/help.txt")"
  ! grep -qF "No flags matched" "$work/help.txt" || fail "$binary --help printed 'No flags matched'"
  ! grep -qF -- "--flagfile" "$work/help.txt" || fail "$binary --help lists Abseil's own flags"
done

# --help names every model family (not only the first three) and says how AdamW behaves.
if [[ -x "$bin/dta-train" ]]; then
  # Abseil wraps help lines at 80 columns: compare on the text with its whitespace collapsed.
  "$bin/dta-train" --help 2>&1 | tr -s ' \n' '  ' >"$work/help.txt"
  for expected in "llama (Llama)" "qwen2 (Qwen2/Qwen2.5)" "qwen3 (Qwen3)" "qwen3_moe (Qwen3-MoE)" \
                  "qwen3_next (Qwen3-Next)" "qwen3-next-small" "betas are (0.9, 0.999)" "eps 1e-8" \
                  "max_grad_norm / (norm + 1e-6)" "applied to every parameter" \
                  "the rate stays at --min_lr_ratio after it" "resumes only into a sharded"; do
    grep -qF -- "$expected" "$work/help.txt" || fail "dta-train --help does not say '$expected'"
  done
fi

# Flag files: one that includes itself used to be read forever, a directory to be skipped silently.
echo "--flagfile=$work/self.flags" >"$work/self.flags"
timeout 60 "$bin/dta-tree" --flagfile="$work/self.flags" "$work/tau2.jsonl" >/dev/null 2>"$work/flags.err"
[[ $? -eq 2 ]] || fail "a flag file that includes itself must exit 2"
grep -qF "includes itself" "$work/flags.err" || fail "the self-including flag file is not named: $(cat "$work/flags.err")"
timeout 60 "$bin/dta-tree" --flagfile="$work" "$work/tau2.jsonl" >/dev/null 2>"$work/flags.err"
[[ $? -eq 2 ]] || fail "a directory as a flag file must exit 2"
grep -qF "is not a regular file" "$work/flags.err" || fail "the directory flag file is not named: $(cat "$work/flags.err")"

# A small model's size reads as a count, not "0.00B".
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
"$bin/dta-layout" --config="$repo/examples/configs/qwen3-tiny.json" --gpu_gb=80 >"$work/layout.txt" 2>&1 || fail "dta-layout (tiny) exited $?"
grep -qE "for [0-9.]+[KM] parameters" "$work/layout.txt" || fail "dta-layout's tiny model count: $(cat "$work/layout.txt")"

# dta-layout: a plan, a refusal naming the numbers (exit 1), bad flags (exit 2), the table.
"$bin/dta-layout" --config=qwen3-8b --gpu_gb=80 >"$work/layout.txt" 2>&1 || fail "dta-layout exited $?"
grep -qF "layout: TP 1 x DP 1, optimizer offloaded to the host for 8.19B parameters" "$work/layout.txt" ||
  fail "dta-layout's 8B plan: $(cat "$work/layout.txt")"
# The executor's memory is estimated (rollouts of 8,192 tokens, automatic B and graph budget)...
grep -qF "activations 13.2 GiB (estimated: stack 3.6, graphs 7.8, workspace 1.1, log-prob head 0.7 GiB for a 8192-token path and 2048 graph tokens)" "$work/layout.txt" ||
  fail "dta-layout's 8B plan shows no executor estimate: $(cat "$work/layout.txt")"
# ... unless a reserve is given.
"$bin/dta-layout" --config=qwen3-8b --gpu_gb=80 --activation_gb=8 >"$work/layout.txt" 2>&1 || fail "dta-layout exited $?"
grep -qF "activations 8.0 GiB; host" "$work/layout.txt" || fail "dta-layout's reserve: $(cat "$work/layout.txt")"
"$bin/dta-layout" --config=qwen3-8b --block_size=0 2>"$work/layout.txt"
[[ $? -eq 2 ]] || fail "a bad --block_size must exit 2"
grep -qF "field 'executor.block_size'" "$work/layout.txt" || fail "the bad --block_size is not named"
"$bin/dta-layout" --config=qwen3-32b --gpu_gb=80 >"$work/layout.txt" 2>&1
[[ $? -eq 1 ]] || fail "a model that cannot fit must exit 1"
grep -qF "cannot be trained on 1 GPU(s) of 80.0 GiB" "$work/layout.txt" || fail "the refusal names no numbers"
"$bin/dta-layout" --config=qwen3-8b --shard_optimizer=maybe 2>"$work/layout.txt"
[[ $? -eq 2 ]] || fail "a bad --shard_optimizer must exit 2"
"$bin/dta-layout" --config=qwen3-8b --world_size=8 --tensor_parallel=3 2>"$work/layout.txt"
[[ $? -eq 2 ]] || fail "a bad --tensor_parallel must exit 2"
grep -qF "field 'tensor_parallel'" "$work/layout.txt" || fail "the bad --tensor_parallel is not named"
"$bin/dta-layout" --table >"$work/table.md" || fail "dta-layout --table exited $?"
[[ $(grep -c '^| qwen3-' "$work/table.md") -eq 60 ]] ||
  fail "the table has not 4 dense models x 2 GPUs x 4 counts and 2 MoE models x 2 GPUs x 7 counts"
grep -qE '^\| qwen3-30b-a3b .* \| 8 \| 141 GiB \| TP 1 x DP 8, EP [248], sharded' "$work/table.md" ||
  fail "Qwen3-30B-A3B on 8 x 141 GiB spreads no experts: $(grep 30b-a3b "$work/table.md")"
"$bin/dta-layout" --config=qwen3-30b-a3b --world_size=8 --expert_parallel=3 2>"$work/layout.txt"
[[ $? -eq 2 ]] || fail "a bad --expert_parallel must exit 2"
grep -qF "field 'expert_parallel'" "$work/layout.txt" || fail "the bad --expert_parallel is not named"

if ((failures)); then
  echo "$failures check(s) failed"
  exit 1
fi
# A balance cost that weighs nothing is refused, naming the flags (exit 2).
if [[ -x "$bin/dta-dispatcher" ]]; then
  "$bin/dta-dispatcher" --wal="$work/balance.wal" --batch_rollouts=4 --vocab_size=10 \
    --balance_per_token=0 --balance_per_key=0 >/dev/null 2>"$work/balance.err"
  [[ $? -eq 2 ]] || fail "a zero balance cost must exit 2"
  grep -qF -- "--balance_per_token / --balance_per_key" "$work/balance.err" || fail "the balance flags are not named: $(cat "$work/balance.err")"
fi

echo "all CLI checks passed"
