#!/usr/bin/env bash
# The benchmark: the service's reserve path side by side with the usual
# alternatives (MySQL alone, Redis DECR/INCR, a Redis lock), against the
# ceilings measured in the same run (Redis EVALSHA of the reserve script, the
# broker, a no-op endpoint behind the same HTTP layers), while another client
# queries the same MariaDB. About five minutes on two cores (plus the first
# build): the strategies, the flood measured with wrk, the sold-out gate across
# two instances, the producer's settings, bots against the waiting room and the
# hot SKU on a Redis Cluster.
#
#   scripts/bench.sh                          # everything, defaults
#   scripts/bench.sh --duration 5 --users 100000 --strategies noop,service
#   scripts/bench.sh --help                   # every size and duration
#
# Writes results/report.md, results/summary.json, results/runs/*.json and, with
# matplotlib (installed from PyPI into .run/bench-venv on first use), the plots
# results/*.png. Extra arguments go to the `compare` binary.
#
# Everything runs on loopback: Redis, MariaDB and the broker from
# scripts/services.sh, and one benchmark server at a time on a free port.
# Other heavy work on the machine (a build, a test suite) skews the figures: the
# report's CPU table shows it in its "other" column.
set -euo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/.."

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
    cargo build --release --locked -p flashsale-bench -q
    exec "${CARGO_TARGET_DIR:-target}"/release/compare --help
fi

scripts/services.sh
# wrk measures the flood section (Debian's package).
if ! command -v wrk >/dev/null 2>&1; then
    echo "bench: installing wrk (Debian package wrk)"
    if [[ $EUID -eq 0 ]]; then sudo=(); else sudo=(sudo); fi
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends wrk >/dev/null
fi
cargo build --release --locked -p flashsale-bench

out=results
for ((i = 1; i <= $#; i++)); do
    if [[ "${!i}" == "--out" ]]; then j=$((i + 1)); out="${!j}"; fi
    if [[ "${!i}" == --out=* ]]; then out="${!i#--out=}"; fi
done
mkdir -p "$out"
rm -f "$out"/*.png

"${CARGO_TARGET_DIR:-target}"/release/compare --repo . --out "$out" "$@"

# Plots: matplotlib in a virtualenv of our own, so the system Python stays as it is.
venv=.run/bench-venv
if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import matplotlib' 2>/dev/null; then
    "$venv/bin/pip" install --quiet --disable-pip-version-check 'matplotlib>=3.7,<4'
fi
"$venv/bin/python" scripts/plots.py "$out"
echo "bench: report in $out/report.md"
