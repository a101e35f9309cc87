#!/usr/bin/env bash
# Make sure the three services flashsale talks to answer on loopback:
#
#   Redis    127.0.0.1:6379
#   MariaDB  127.0.0.1:3306  (root, empty password, database `flashsale`)
#   Kafka    127.0.0.1:${KAFKA_PORT:-9092}  (the Kafka-compatible broker `tansu`)
#
# Idempotent and safe to run twice, from any directory: a service that already
# answers is left alone; a missing one is installed (apt-get / cargo install)
# and started. Prints one line per service and a summary line at the end.
#
# Usage:
#   scripts/services.sh              # ensure all three services are up
#   scripts/services.sh stop-kafka   # stop the tansu broker this script started
#   scripts/services.sh check-kafka-fds  # fail if that broker holds a descriptor it inherited
#   scripts/services.sh kafka-quirks     # "tansu-0.6" while that broker runs, else "none"
#
# No Docker here on purpose: the dev/CI machine has no Docker engine and no
# Apache Kafka package. See docker-compose.yml for users who do have Docker.
set -euo pipefail

REPO_ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)"
KAFKA_PORT="${KAFKA_PORT:-9092}"
KAFKA_DIR="$REPO_ROOT/.run/kafka"
KAFKA_PID_FILE="$KAFKA_DIR/tansu.pid"
KAFKA_LOG="$KAFKA_DIR/tansu.log"
TANSU_VERSION="0.6.0"

REDIS_PORT=6379
MYSQL_PORT=3306
MYSQL_DB=flashsale

log() { printf '%s\n' "$*"; }
die() { printf 'services.sh: error: %s\n' "$*" >&2; exit 1; }

# Run privileged commands directly as root, through sudo otherwise.
as_root() {
    if [[ $EUID -eq 0 ]]; then "$@"; else sudo "$@"; fi
}

# `apt-get update` at most once per run, and only when something must be installed.
APT_UPDATED=0
apt_install() {
    if [[ $APT_UPDATED -eq 0 ]]; then
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
        APT_UPDATED=1
    fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"
}

# True when something accepts TCP connections on 127.0.0.1:$1. The redirection
# runs in a subshell under `timeout` so a filtered port cannot hang us.
port_open() {
    timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null
}

# wait_until <tries> <sleep-seconds> <command...>: bounded retry loop.
wait_until() {
    local tries=$1 pause=$2
    shift 2
    local i
    for ((i = 0; i < tries; i++)); do
        if "$@"; then return 0; fi
        sleep "$pause"
    done
    return 1
}

# ---------------------------------------------------------------- Redis ----

redis_ok() {
    [[ "$(redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null)" == "PONG" ]]
}

ensure_redis() {
    if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
        log "redis: redis-server not installed, installing it with apt-get"
        apt_install redis-server
    fi
    if redis_ok; then
        log "redis: already running on 127.0.0.1:$REDIS_PORT"
        return
    fi
    mkdir -p /var/lib/redis /var/log/redis
    # Same command the machine image uses; nothing is persisted (--save "",
    # no AOF): Redis only holds the pre-reservation cache, MySQL is the truth.
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$REDIS_PORT" \
        --save "" --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log
    if ! wait_until 50 0.2 redis_ok; then
        tail -n 20 /var/log/redis/ci.log >&2 2>/dev/null || true
        die "redis did not answer PING on 127.0.0.1:$REDIS_PORT within 10 s (log: /var/log/redis/ci.log)"
    fi
    log "redis: started on 127.0.0.1:$REDIS_PORT"
}

# -------------------------------------------------------------- MariaDB ----

# Debian 12 ships both names; older/newer packages may only have one of them.
mysql_admin_bin() { command -v mariadb-admin || command -v mysqladmin; }
mysql_client_bin() { command -v mariadb || command -v mysql; }

mysql_alive() {
    "$(mysql_admin_bin)" --protocol=TCP -h127.0.0.1 -P"$MYSQL_PORT" -uroot \
        --connect-timeout=2 ping >/dev/null 2>&1
}

# root over TCP with an empty password: what the app and the tests use.
mysql_tcp() {
    "$(mysql_client_bin)" --protocol=TCP -h127.0.0.1 -P"$MYSQL_PORT" -uroot \
        --connect-timeout=5 "$@"
}

ensure_mariadb() {
    local started=0
    if [[ ! -x /usr/sbin/mariadbd ]] || ! mysql_admin_bin >/dev/null || ! mysql_client_bin >/dev/null; then
        log "mariadb: not installed, installing mariadb-server and mariadb-client with apt-get"
        apt_install mariadb-server mariadb-client
    fi
    if ! mysql_alive; then
        # Fresh installs (no systemd in containers) may lack the socket dir.
        as_root mkdir -p /run/mysqld
        as_root chown mysql:mysql /run/mysqld
        as_root start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
        wait_until 150 0.2 mysql_alive ||
            die "mariadb did not answer on 127.0.0.1:$MYSQL_PORT within 30 s (see /var/log/mysql/ or journal)"
        started=1
    fi

    # Only touch authentication when root@127.0.0.1 with an empty password does
    # not already work (it does on the dev machine). On a fresh Debian install
    # root is unix_socket-only, so fix it through the socket: keep socket auth
    # and add an empty-password TCP login for root.
    if ! mysql_tcp -e 'SELECT 1' >/dev/null 2>&1; then
        log "mariadb: root@127.0.0.1 cannot log in with an empty password; enabling it via the local socket"
        as_root "$(mysql_client_bin)" -uroot -e "
            ALTER USER 'root'@'localhost' IDENTIFIED VIA unix_socket OR mysql_native_password USING PASSWORD('');
            CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY '';
            GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;
            FLUSH PRIVILEGES;" ||
            die "could not configure root login for mariadb"
        mysql_tcp -e 'SELECT 1' >/dev/null 2>&1 ||
            die "root@127.0.0.1 still cannot log in to mariadb with an empty password"
    fi

    mysql_tcp -e "CREATE DATABASE IF NOT EXISTS \`$MYSQL_DB\`" ||
        die "could not create database $MYSQL_DB"

    if [[ $started -eq 1 ]]; then
        log "mariadb: started on 127.0.0.1:$MYSQL_PORT (database $MYSQL_DB ensured)"
    else
        log "mariadb: already running on 127.0.0.1:$MYSQL_PORT (database $MYSQL_DB ensured)"
    fi
}

# ---------------------------------------------------------------- Kafka ----
# tansu (crates.io), an Apache-Kafka-compatible broker in Rust, with SQLite
# storage (there is no Apache Kafka package or Docker engine on the dev/CI
# machine). Its default features cannot run a broker, hence the features below;
# `memory://` storage loses data and stalls consumers resuming mid-batch, hence
# sqlite. tansu never auto-creates topics: the app creates them at startup.

find_tansu() {
    if command -v tansu 2>/dev/null; then return 0; fi
    # `cargo install` puts it here, which may not be on PATH (e.g. under sudo).
    local bin="${CARGO_HOME:-$HOME/.cargo}/bin/tansu"
    if [[ -x "$bin" ]]; then
        printf '%s\n' "$bin"
        return 0
    fi
    return 1
}

# Pid from our pid file if that process is still a running tansu, else nothing.
kafka_pid() {
    local pid
    [[ -f "$KAFKA_PID_FILE" ]] || return 1
    pid="$(cat "$KAFKA_PID_FILE" 2>/dev/null || true)"
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null || return 1
    # Guard against pid reuse: only accept a process that is really tansu.
    grep -qa 'tansu' "/proc/$pid/cmdline" 2>/dev/null || return 1
    printf '%s\n' "$pid"
}

kafka_up() { port_open "$KAFKA_PORT"; }

ensure_kafka() {
    # tansu 0.6 can panic in its storage task and keep the port open while
    # refusing every request; a broker of ours in that state is restarted.
    local broken_pid
    if kafka_up && broken_pid="$(kafka_pid)" && grep -q "panicked at" "$KAFKA_LOG" 2>/dev/null; then
        log "kafka: tansu (pid $broken_pid) panicked earlier (see $KAFKA_LOG); restarting it"
        kill "$broken_pid" 2>/dev/null || true
        wait_until 50 0.2 bash -c "! kill -0 $broken_pid 2>/dev/null" || kill -9 "$broken_pid" 2>/dev/null || true
        mv -f "$KAFKA_LOG" "$KAFKA_LOG.panicked" 2>/dev/null || true
        rm -f "$KAFKA_PID_FILE"
    fi
    if kafka_up; then
        log "kafka: already running on 127.0.0.1:$KAFKA_PORT (something answers on the port)"
        return
    fi

    mkdir -p "$KAFKA_DIR"

    # A broker we started earlier that is alive but not (yet) listening.
    local pid
    if pid="$(kafka_pid)"; then
        if wait_until 50 0.2 kafka_up; then
            log "kafka: already running on 127.0.0.1:$KAFKA_PORT (tansu pid $pid)"
            return
        fi
        tail -n 30 "$KAFKA_LOG" >&2 2>/dev/null || true
        die "tansu (pid $pid, from $KAFKA_PID_FILE) runs but does not listen on 127.0.0.1:$KAFKA_PORT; stop it with: $0 stop-kafka"
    fi
    rm -f "$KAFKA_PID_FILE" # stale

    local tansu
    if ! tansu="$(find_tansu)"; then
        command -v cargo >/dev/null 2>&1 || die "tansu is not installed and cargo is not on PATH"
        log "kafka: tansu not found; installing tansu $TANSU_VERSION with cargo (takes 10 to 20 minutes on 2 cores)"
        cargo install tansu --version "$TANSU_VERSION" --locked --features dynostore,libsql
        tansu="$(find_tansu)" || die "cargo install finished but no tansu binary was found"
    fi

    # Start detached (own session, stdin closed) so it outlives this script
    # and the terminal. The working directory matters:
    #  - `sqlite://tansu.db` is relative on purpose: tansu 0.6.0 fails with an
    #    absolute `sqlite:///abs/path`, so the data lands in $KAFKA_DIR/tansu.db;
    #  - tansu loads a `.env` from its cwd, and .run/kafka has none.
    # The listener is pinned to 127.0.0.1 (tansu's default is 0.0.0.0).
    # No `setsid -f`: without job control the background child is not a group
    # leader, so setsid (and nohup) exec in place and $! is tansu's own pid.
    # Every descriptor above stderr is closed first: the broker outlives this
    # script, and a pipe it inherited (a CI runner's, a `| tee`) would keep
    # the reader of that pipe waiting for an end that never comes.
    (
        cd "$KAFKA_DIR"
        close_inherited_fds
        setsid nohup "$tansu" broker \
            --listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
            --advertised-listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
            --storage-engine "sqlite://tansu.db" \
            </dev/null >>"$KAFKA_LOG" 2>&1 &
        echo $! >"$KAFKA_PID_FILE"
    )

    # Up to 10 s (it normally listens within ~30 ms); stop early if it exited.
    local i new_pid up=0
    new_pid="$(cat "$KAFKA_PID_FILE")"
    for ((i = 0; i < 50; i++)); do
        if kafka_up; then up=1; break; fi
        kill -0 "$new_pid" 2>/dev/null || break
        sleep 0.2
    done
    if [[ $up -eq 0 ]]; then
        # Leave nothing half-started behind (no orphan without a pid file).
        kill -TERM "$new_pid" 2>/dev/null || true
        rm -f "$KAFKA_PID_FILE"
        log "kafka: tansu did not listen on 127.0.0.1:$KAFKA_PORT (exited or timed out after 10 s); last lines of $KAFKA_LOG:" >&2
        tail -n 30 "$KAFKA_LOG" >&2 || true
        die "kafka broker failed to start"
    fi
    log "kafka: started tansu on 127.0.0.1:$KAFKA_PORT (pid $new_pid, data $KAFKA_DIR/tansu.db, log $KAFKA_LOG)"
}

# Closes this (sub)shell's descriptors above 2, so that what it starts inherits
# only stdin, stdout and stderr.
close_inherited_fds() {
    local fd
    for fd in /proc/self/fd/*; do
        fd="${fd##*/}"
        if [[ "$fd" =~ ^[0-9]+$ && "$fd" -gt 2 ]]; then
            eval "exec $fd>&-" 2>/dev/null || true
        fi
    done
}

# Fails when the broker this script started holds a pipe or a terminal: a
# descriptor it inherited rather than opened (its own are sockets and files).
check_kafka_fds() {
    [[ -f "$KAFKA_PID_FILE" ]] || { log "kafka: not started by this script; nothing to check"; return 0; }
    local pid held
    pid="$(cat "$KAFKA_PID_FILE")"
    [[ -d "/proc/$pid/fd" ]] || die "tansu (pid $pid) is not running"
    held="$(find "/proc/$pid/fd" -mindepth 1 -maxdepth 1 -printf '%f -> %l\n' 2>/dev/null \
        | grep -E -- '-> (pipe:|/dev/pts/|/dev/tty)' || true)"
    if [[ -n "$held" ]]; then
        log "kafka: tansu (pid $pid) holds descriptors it inherited:" >&2
        log "$held" >&2
        return 1
    fi
    log "kafka: tansu (pid $pid) holds no inherited descriptor"
}

stop_kafka() {
    local pid i
    if ! pid="$(kafka_pid)"; then
        rm -f "$KAFKA_PID_FILE"
        log "kafka: no tansu started by this script is running (pid file: $KAFKA_PID_FILE)"
        return
    fi
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        kill -KILL "$pid" 2>/dev/null || true
        log "kafka: tansu (pid $pid) ignored SIGTERM for 5 s, killed"
    else
        log "kafka: stopped tansu (pid $pid)"
    fi
    rm -f "$KAFKA_PID_FILE"
}

# ----------------------------------------------------------------- main ----

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

case "${1:-up}" in
    up | start | all)
        ensure_redis
        ensure_mariadb
        ensure_kafka
        log "services: all up: redis 127.0.0.1:$REDIS_PORT, mariadb 127.0.0.1:$MYSQL_PORT/$MYSQL_DB, kafka 127.0.0.1:$KAFKA_PORT"
        ;;
    stop-kafka)
        stop_kafka
        ;;
    check-kafka-fds)
        check_kafka_fds
        ;;
    kafka-quirks)
        # The broker's defects the service must work around
        # (kafka.broker_quirks): tansu's when the broker on the port is the
        # tansu this script started, none for any other (Apache Kafka from
        # docker-compose.yml, say).
        if kafka_pid >/dev/null; then echo "tansu-0.6"; else echo "none"; fi
        ;;
    -h | --help | help)
        usage
        ;;
    *)
        usage >&2
        exit 2
        ;;
esac
