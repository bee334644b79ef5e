#!/usr/bin/env bash
# A/B wall time of test files: BASE (a commit, default: where this branch left main) vs the working tree, alternating
# rounds in one run so the machine's load hits both alike; prints per round and the medians.
#   scripts/suite_time_ab.sh [-r ROUNDS] [-b BASE] FILE...      (e.g. tests/e2e/test_shutdown.py)
# Wrap in `flock /tmp/measure.lock` on a shared machine; note `uptime` next to the figures.
set -euo pipefail
rounds=3 base=$(git merge-base main HEAD)
while getopts "r:b:" o; do case $o in r) rounds=$OPTARG;; b) base=$OPTARG;; *) exit 2;; esac; done
shift $((OPTIND - 1))
[ $# -gt 0 ] || { echo "usage: $0 [-r ROUNDS] [-b BASE] FILE..." >&2; exit 2; }
root=$(git rev-parse --show-toplevel)
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=/work/main/.venv/bin/python
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The base tree keeps its path between runs: the C++ kernels are cached per source path.
basedir=${BASE_DIR:-/tmp/suite-ab-base-$(basename "$root")}
rm -rf "$basedir" && mkdir -p "$basedir"  # an export, not a worktree: the repository is left as it is
git -C "$root" archive "$base" | tar -x -C "$basedir"
for d in "$basedir" "$root"; do  # build the kernels outside the timed runs (SKIP_BUILD=1: don't)
  [ -z "${SKIP_BUILD:-}" ] || break
  (cd "$d" && PYTHONPATH="$d" "$py" -m llmserve.ops.cpu_ops >/dev/null 2>&1) || true
done
run() {  # $1: tree; prints wall seconds of one pytest run of the files
  local t0 t1
  t0=$(date +%s.%N)
  (cd "$1" && PYTHONPATH="$1" "$py" -m pytest -q -x -p no:cacheprovider -m "not slow" "${@:2}" >"$tmp/log" 2>&1) \
    || { tail -20 "$tmp/log" >&2; echo "FAILED in $1" >&2; exit 1; }
  t1=$(date +%s.%N)
  echo "$t1 - $t0" | bc
}
a=() b=()
for i in $(seq "$rounds"); do
  a+=("$(run "$basedir" "$@")"); b+=("$(run "$root" "$@")")
  echo "round $i: base ${a[-1]} s, tree ${b[-1]} s ($(uptime | sed 's/.*load/load/'))"
done
med() { printf '%s\n' "$@" | sort -n | awk '{v[NR]=$1} END {print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }
ma=$(med "${a[@]}") mb=$(med "${b[@]}")
echo "median: base $ma s, tree $mb s, saved $(echo "$ma - $mb" | bc) s, ratio $(echo "scale=2; $mb / $ma" | bc)"
