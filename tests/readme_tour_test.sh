#!/usr/bin/env bash
# Runs the README's quick tour as written: every ```bash block of its "Quick tour" section, each as
# one script from the repository root, with /tmp/ replaced by a directory of this test's own. A
# block fails the test when any command in it fails (set -e), when it runs past its time (a
# service waiting forever), or when it leaves a background process running. Then checks what the
# tour promises: the trainers' checkpoints.
# Usage: readme_tour_test.sh REPO_ROOT
set -uo pipefail
repo="$1"
cd "$repo" || exit 1
source "$(dirname "${BASH_SOURCE[0]}")/shell_checks.sh"

# The blocks, one file each (block-1.sh, ...).
awk -v dir="$work" '
  /^## Quick tour/ { tour = 1; next }
  /^## / && tour { tour = 0 }
  tour && /^```bash/ { n++; file = dir "/block-" n ".sh"; inside = 1; next }
  inside && /^```/ { inside = 0; close(file); next }
  inside { print > file }
' README.md
blocks=("$work"/block-*.sh)
[[ -e "${blocks[0]}" ]] || { echo "FAIL: no bash blocks under README's Quick tour"; exit 1; }

for block in "${blocks[@]}"; do
  name="$(basename "$block" .sh)"
  sed -i "s|/tmp/|$work/|g" "$block"
  # set -e, and every background job must be gone when the block ends.
  { echo "set -e"; cat "$block"; echo 'wait'; } >"$block.run"
  timeout 900 bash "$block.run" >"$work/$name.log" 2>&1
  status=$?
  if ((status != 0)); then
    fail "$name exited $status:"
    sed 's/^/    /' "$block"
    tail -30 "$work/$name.log"
  fi
done

# The services part trained two steps and published checkpoints.
ckpt="$work/dta-tour/ckpt"
ls "$ckpt" 2>/dev/null | grep -qx "step-0*2" || fail "the tour's trainers left no step-2 checkpoint: $(ls "$ckpt" 2>&1)"
grep -q '"step": *2' "$ckpt/latest.json" 2>/dev/null || fail "latest.json does not name step 2: $(cat "$ckpt/latest.json" 2>&1)"

if ((failures)); then
  echo "$failures failure(s)"
  exit 1
fi
echo "readme tour: ${#blocks[@]} blocks ran"
