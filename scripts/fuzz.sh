#!/usr/bin/env bash
# The HTTP API against its own OpenAPI document: schemathesis (property-based,
# from PyPI, in .run/tools-venv) generates requests for every operation, valid
# and not, with a user token and the admin token, and checks every answer: no
# 5xx, every status, header and body as the document says.
#
# Starts its own `flashsale serve` on a free port with a database, topic and
# group of its own (the services must be up: scripts/services.sh), and removes
# them afterwards. Extra arguments go to `st run` (e.g. --max-examples 200).
set -euo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/.."

scripts/tools.sh >/dev/null
cargo build --locked -q --bin flashsale
bin="${CARGO_TARGET_DIR:-target}/debug/flashsale"
st=.run/tools-venv/bin/st

id="fuzz$(date +%s)$RANDOM"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
work=$(mktemp -d)
export FLASHSALE_ENV=test
export FLASHSALE__SERVER__ADDR="127.0.0.1:$port"
export FLASHSALE__MYSQL__URL="mysql://root@127.0.0.1:3306/flashsale_t_$id"
export FLASHSALE__KAFKA__TOPIC="flash.$id"
export FLASHSALE__KAFKA__DEAD_LETTER_TOPIC="flash.$id.dlq"
export FLASHSALE__KAFKA__GROUP_ID="flashsale-$id"
export FLASHSALE__CONSUMER__METRICS_ADDR="127.0.0.1:0"
admin="fuzz-admin-$id"
export FLASHSALE__AUTH__ADMIN_TOKEN="$admin"
# The fuzzer sends thousands of requests from one address and one user.
export FLASHSALE__RATE_LIMIT__PER_IP_PER_SEC=0
export FLASHSALE__RATE_LIMIT__PER_USER_PER_SEC=0

cleanup() {
    [[ -n "${server:-}" ]] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
    # The activities the run created (the fuzzer creates many) leave keys in the
    # shared Redis: drop them with the run's database.
    local ids
    ids=$(mariadb -h127.0.0.1 -uroot -N -B -e "SELECT id FROM \`flashsale_t_$id\`.activities" 2>/dev/null || true)
    for a in $ids; do
        for pattern in "flash:{$a}:*" "flash:{$a#*"; do
            redis-cli -h 127.0.0.1 --scan --pattern "$pattern" | xargs -r redis-cli -h 127.0.0.1 DEL >/dev/null || true
        done
    done
    mariadb -h127.0.0.1 -uroot -e "DROP DATABASE IF EXISTS \`flashsale_t_$id\`" || true
    rm -rf "$work"
}
trap cleanup EXIT

"$bin" migrate >/dev/null
"$bin" serve >"$work/serve.log" 2>&1 &
server=$!
for _ in $(seq 1 300); do
    if curl -sf "http://127.0.0.1:$port/healthz" >/dev/null; then break; fi
    sleep 0.1
done
curl -sf "http://127.0.0.1:$port/healthz" >/dev/null || { cat "$work/serve.log"; exit 1; }

user=$("$bin" token --user fuzzer)
# A sale for the SKU-shaped paths to find.
now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
later=$(date -u -d '+1 hour' +%Y-%m-%dT%H:%M:%SZ)
curl -sf -X POST "http://127.0.0.1:$port/admin/activities" \
    -H "Authorization: Bearer $admin" -H 'Content-Type: application/json' \
    -d "{\"id\": \"$id\", \"sku\": \"$id\", \"stock\": 1000000, \"starts_at\": \"$now\", \"ends_at\": \"$later\"}" >/dev/null
curl -sf -X POST "http://127.0.0.1:$port/admin/activities/$id/preload" \
    -H "Authorization: Bearer $admin" >/dev/null

cat >"$work/schemathesis.toml" <<TOML
workers = 2
request-timeout = 10.0
generation.max-examples = 25

# 503 paused / unavailable are documented answers (the fuzzer pauses the sale
# itself); any undocumented status, a 500 among them, still fails
# status_code_conformance.
checks.not_a_server_error.enabled = false

[auth.openapi.user]
bearer = "$user"
[auth.openapi.admin]
bearer = "$admin"

# Rules between fields JSON Schema cannot state: per_user_limit <= stock,
# ends_at after starts_at (activities); quantity <= the activity's own
# per-user limit (reservations). Their 422s are the contract.
[[operations]]
include-path = "/admin/activities"
include-method = "POST"
checks.positive_data_acceptance.enabled = false

[[operations]]
include-path = "/flash/{sku}/reserve"
include-method = "POST"
checks.positive_data_acceptance.enabled = false
TOML

"$st" --config-file "$work/schemathesis.toml" run "http://127.0.0.1:$port/openapi.json" "$@"
