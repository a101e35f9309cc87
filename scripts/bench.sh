#!/usr/bin/env bash
# The benchmark: the service's reserve path side by side with the usual
# alternatives (MySQL alone, Redis DECR/INCR, a Redis lock), against the
# ceilings measured in the same run (Redis EVALSHA of the reserve script, the
# broker, a no-op endpoint behind the same HTTP layers), while another client
# queries the same MariaDB. About five minutes on two cores (plus the first
# build): the strategies, the flood measured with wrk, the sold-out gate across
# two instances, the producer's settings, bots against the waiting room, the
# hot SKU on a Redis Cluster, and a sale through the loss of a Cluster primary.
#
#   scripts/bench.sh                          # everything, defaults
#   scripts/bench.sh --duration 5 --users 100000 --strategies noop,service
#   scripts/bench.sh --help                   # every size and duration
#   scripts/bench.sh consumer                 # the order consumer alone (below)
#   scripts/bench.sh mega                     # the mega-sale alone (below)
#
# Writes results/report.md, results/summary.json, results/runs/*.json and, with
# matplotlib (installed from PyPI into .run/bench-venv on first use), the plots
# results/*.png. Extra arguments go to the `compare` binary.
#
# The failover section (--failover-units, 0 skips it) starts a Cluster of its
# own, measures the service's rate on it with redis.min_replicas_acked = 1,
# drives a sale at half that rate (every user clicking twice), SIGKILLs the
# primary that owns the sale's slot 3 s in, restarts the dead node on its old
# address halfway through the --failover-after seconds the sale goes on past
# the promotion, and plots answers per 100 ms by status (202, 409, 503) with
# the time without service in the report (results/failover.png). Alone:
#
#   scripts/bench.sh --strategies noop --duration 2 --half-rate-duration 0 \
#       --idle-duration 1 --redis-bench-requests 0 --broker-ceiling-duration 0 \
#       --flood-duration 0 --gate-units 0 --producer-duration 0 \
#       --fairness-users 0 --cluster-units 0
#
# `scripts/bench.sh consumer` prints the order consumer's throughput into MariaDB
# for batch sizes 1, 10, 100 and 500 (BENCH_ORDERS orders a run, 10,000 if unset):
# the benchmark crate's `cargo bench` target, `cargo bench -p flashsale-bench
# --bench consumer` once the services run.
#
# `scripts/bench.sh mega` runs the mega-sale instead of the sections above (the
# same as `--mega`, into results/mega unless --out says otherwise): 100,000
# units, 1,000,000 users each with a token of their own clicking twice, once
# with open admission and once through a waiting room they all join before the
# start, for stock_shards 1 and 3, on services started with
# FLASHSALE_ENV=production; beside them the Redis and broker ceilings and the
# flood's /healthz, no-op, sold-out and refused phases with the production and
# the test configuration; then the scale-out plan. Tens of minutes at full size;
# sizes are flags, e.g. a run of about a minute:
#
#   scripts/bench.sh mega --mega-users 20000 --mega-units 2000 --flood-duration 2 \
#       --flood-rounds 1 --idle-duration 1 --redis-bench-requests 50000 \
#       --broker-ceiling-duration 2
#
# `scripts/bench.sh day` runs a day in production instead (into results/day):
# first the other business's query with the consumers writing against them
# paused, in the same sale, for each consumer setting; then 24 sales over about
# 15 minutes on a Redis Cluster, a broker, two API instances and two consumers of
# its own (`FLASHSALE_ENV=production`), staggered and overlapping, open and
# through waiting rooms, on 1 and 3 stock shards, with top-ups, a pause, unpaid
# orders lapsing, users buying in several sales, and three faults struck on one
# sale while others sell; then the cost of a poll, and the tail until every
# sale's keys are gone. About 25 minutes; sizes are flags (`--sales`,
# `--minutes`, `--clicks-per-s`, ...; `scripts/bench.sh day --help`). It fails
# when a sale breaks an invariant, and asserts nothing else.
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
if [[ "${1:-}" == "day" ]]; then
    shift
    cargo build --release --locked -p flashsale-bench --bin day
    cargo build --release --locked --bin flashsale
    out=results/day
    given=()
    for ((i = 1; i <= $#; i++)); do
        case "${!i}" in
            -h | --help) exec "${CARGO_TARGET_DIR:-target}"/release/day --help ;;
            --out) j=$((i + 1)); out="${!j}"; given=(x) ;;
            --out=*) out="${!i#--out=}"; given=(x) ;;
        esac
    done
    if [[ ${#given[@]} -eq 0 ]]; then set -- --out "$out" "$@"; fi
    status=0
    "${CARGO_TARGET_DIR:-target}"/release/day --repo . "$@" || status=$?
    if [[ -f "$out/day.json" ]]; then
        venv=.run/bench-venv
        [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
        "$venv/bin/python" -c 'import matplotlib' 2>/dev/null ||
            "$venv/bin/pip" install --quiet --disable-pip-version-check 'matplotlib>=3.7,<4'
        "$venv/bin/python" scripts/plots.py "$out"
        echo "bench: report in $out/report.md"
    fi
    exit "$status"
fi
if [[ "${1:-}" == "consumer" ]]; then
    exec cargo bench --locked -p flashsale-bench --bench consumer
fi
out=results
if [[ "${1:-}" == "mega" ]]; then
    shift
    set -- --mega "$@"
    out=results/mega
fi
# wrk measures the flood section (Debian's package).
if ! command -v wrk >/dev/null 2>&1; then
    echo "bench: installing wrk (Debian package wrk)"
    if [[ $EUID -eq 0 ]]; then sudo=(); else sudo=(sudo); fi
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends wrk >/dev/null
fi
cargo build --release --locked -p flashsale-bench

given_out=()
for ((i = 1; i <= $#; i++)); do
    if [[ "${!i}" == "--out" ]]; then j=$((i + 1)); out="${!j}"; given_out=(x); fi
    if [[ "${!i}" == --out=* ]]; then out="${!i#--out=}"; given_out=(x); fi
done
mkdir -p "$out"
rm -f "$out"/*.png

if [[ ${#given_out[@]} -eq 0 ]]; then set -- --out "$out" "$@"; fi
"${CARGO_TARGET_DIR:-target}"/release/compare --repo . "$@"

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
