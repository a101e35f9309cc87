#!/usr/bin/env bash
# A Redis Cluster on loopback: 3 primaries and 3 replicas on ports 7001-7006
# (REDIS_CLUSTER_PORT moves the first), nothing kept on disk, for the tests that
# run once more against a Cluster and for trying scale-out by hand.
#
#   scripts/redis-cluster.sh [start]   # idempotent: a healthy cluster is left alone
#   scripts/redis-cluster.sh stop      # stops the six nodes this script started
#   scripts/redis-cluster.sh url       # the redis.url for it (redis+cluster://...)
#
# The nodes' logs and cluster files live in .run/redis-cluster/.
set -euo pipefail

REPO_ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)"
DIR="$REPO_ROOT/.run/redis-cluster"
FIRST="${REDIS_CLUSTER_PORT:-7001}"
PORTS=()
for ((i = 0; i < 6; i++)); do PORTS+=($((FIRST + i))); done

log() { printf 'redis-cluster: %s\n' "$*"; }
die() { printf 'redis-cluster: error: %s\n' "$*" >&2; exit 1; }

ping() { [[ "$(redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null)" == "PONG" ]]; }
info() { redis-cli -h 127.0.0.1 -p "$1" cluster info 2>/dev/null | tr -d '\r'; }
healthy() {
    local p
    for p in "${PORTS[@]}"; do
        ping "$p" || return 1
        info "$p" | grep -q '^cluster_state:ok$' || return 1
        info "$p" | grep -q '^cluster_known_nodes:6$' || return 1
    done
}

# Every daemon argument in one place.
start_node() {
    redis-server --port "$1" --bind 127.0.0.1 \
        --cluster-enabled yes --cluster-config-file "nodes-$1.conf" \
        --cluster-node-timeout 2000 --repl-diskless-sync-delay 0 \
        --save '' --appendonly no --dir "$DIR" \
        --daemonize yes --logfile "$DIR/$1.log" --pidfile "$DIR/$1.pid"
}

stop() {
    local p
    for p in "${PORTS[@]}"; do
        redis-cli -h 127.0.0.1 -p "$p" shutdown nosave >/dev/null 2>&1 || true
    done
    rm -f "$DIR"/nodes-*.conf
    log "stopped"
}

start() {
    command -v redis-server >/dev/null && command -v redis-cli >/dev/null \
        || die "redis-server and redis-cli are needed (scripts/services.sh installs them)"
    if healthy; then
        log "already running on ${PORTS[*]}"
        return
    fi
    # Anything half-made (a node down, a cluster not formed) is started afresh:
    # nothing is kept on disk, so there is nothing to lose.
    stop >/dev/null
    mkdir -p "$DIR"
    local p i
    for p in "${PORTS[@]}"; do start_node "$p"; done
    for ((i = 0; i < 50; i++)); do
        local all=1
        for p in "${PORTS[@]}"; do ping "$p" || all=0; done
        [[ $all -eq 1 ]] && break
        sleep 0.2
    done
    local nodes=()
    for p in "${PORTS[@]}"; do nodes+=("127.0.0.1:$p"); done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >"$DIR/create.log" 2>&1 \
        || { cat "$DIR/create.log" >&2; die "redis-cli --cluster create failed"; }
    for ((i = 0; i < 100; i++)); do
        if healthy; then
            log "started: 3 primaries and 3 replicas on ${PORTS[*]}"
            return
        fi
        sleep 0.2
    done
    die "the cluster did not reach cluster_state:ok within 20 s (logs in $DIR)"
}

url() {
    local nodes=()
    local p
    for p in "${PORTS[@]:0:3}"; do nodes+=("127.0.0.1:$p"); done
    local IFS=,
    printf 'redis+cluster://%s\n' "${nodes[*]}"
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    url) url ;;
    -h | --help | help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" ;;
    *) die "unknown command ${1}; see --help" ;;
esac
