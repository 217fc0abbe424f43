#!/usr/bin/env bash
# Smoke test of dta-linear-attention-bench on the CPU (both columns take the ATen paths there): the
# rule and the mixer at one chunk length print their table rows with the two paths agreeing,
# --profile writes a profile section per case, and bad flags exit 2 naming what is wrong.
# Usage: linear_attention_bench_smoke_test.sh BIN_DIR
set -uo pipefail
bin="$1"
source "$(dirname "${BASH_SOURCE[0]}")/../shell_checks.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

"$bin/dta-linear-attention-bench" --device=cpu --tokens=64 --what=rule,mix --runs=1 --warmups=0 \
  --profile="$work/profile.md" >"$work/stdout.txt" 2>"$work/stderr.txt"
status=$?
[[ $status -eq 0 ]] || fail "exited $status: $(tail -5 "$work/stderr.txt")"
for what in rule mix; do
  row="$(grep -E "^\| $what \| 64 \|" "$work/stdout.txt")"
  [[ -n "$row" ]] || fail "no $what row: $(cat "$work/stdout.txt")"
  # The last column: both paths' largest differences, the same ATen ops on the CPU.
  [[ "$row" == *"| 0.0e+00 / 0.0e+00 |" ]] || fail "$what: the two CPU paths differ: $row"
  grep -q "^## Profile: $what at T = 64" "$work/profile.md" || fail "no $what profile section"
done
grep -q "aten::" "$work/profile.md" || fail "the profile names no operator"

"$bin/dta-linear-attention-bench" --device=cpu --tokens=0 >/dev/null 2>"$work/bad.txt"
[[ $? -eq 2 ]] && grep -q "not a positive length" "$work/bad.txt" || fail "--tokens=0 not refused"
"$bin/dta-linear-attention-bench" --device=cpu --tokens=64 --profile=/nonexistent/dir/p.md \
  >/dev/null 2>"$work/bad.txt"
[[ $? -eq 2 ]] && grep -q "cannot write" "$work/bad.txt" || fail "an unwritable --profile not refused"

((failures == 0)) && echo "linear_attention_bench_smoke_test: ok"
exit $((failures > 0))
