#!/usr/bin/env bash
# Runs the fault suite N times in a row (5 by default), each time from a clean
# clone of this repository's HEAD, as docs/DESIGN.md, "Availability", asks: the
# suite must pass every time, not most times.
#
#   scripts/faults-loop.sh        # five runs
#   scripts/faults-loop.sh 10     # ten
#
# Each run's whole output is kept in .run/faults-loop/run-K.log; the summary
# lists every run's closing line and, for a run that failed, its broken rows.
# Services come from scripts/services.sh (started once, left running), and
# faketime, which the suite runs skewed instances with, from scripts/tools.sh.
# Exits non-zero when any run failed.
set -euo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/.."

runs="${1:-5}"
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 [runs]" >&2; exit 2; }

scripts/services.sh
scripts/tools.sh faketime
out="$PWD/.run/faults-loop"
mkdir -p "$out"
# Every run clones into the same place and builds into a folder of the loop's
# own: a run recompiles only the workspace's crates, and the working tree's
# own build (whose test binaries know their source folder) is left alone.
clone="$out/clone"
export CARGO_TARGET_DIR="$out/target"
trap 'rm -rf "$clone"' EXIT

passed=0 failed=0
for ((k = 1; k <= runs; k++)); do
    rm -rf "$clone"
    git clone --quiet --no-hardlinks . "$clone"
    log="$out/run-$k.log"
    started=$(date +%s)
    # A failing scenario keeps its processes' logs (the path is in the run's log).
    if (cd "$clone" && FAULTS_KEEP=1 cargo test --locked --test faults) >"$log" 2>&1; then
        passed=$((passed + 1)); verdict=passed
    else
        failed=$((failed + 1)); verdict=FAILED
    fi
    echo "run $k: $verdict in $(( $(date +%s) - started )) s: $(grep -E '^faults: ' "$log" | tail -1)"
    grep -E '\| BROKEN \|' "$log" || true
done
echo "fault suite runs: $passed passed, $failed failed (logs in .run/faults-loop/)"
[[ $failed -eq 0 ]]
