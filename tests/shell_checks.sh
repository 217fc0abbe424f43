# Sourced by the shell tests (cli_test.sh, readme_tour_test.sh, the bench smoke tests): $work, a
# scratch directory removed on exit, and `fail MESSAGE`, which prints the message and counts it in
# $failures; each test reports and exits on the count in its own words.
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
