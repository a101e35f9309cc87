#!/usr/bin/env bash
# Runs the whole test suite against real services on loopback.
#
#   scripts/test.sh            # everything
#   scripts/test.sh seed_test  # extra arguments go to `cargo test` (a name filter)
#
# Starts (and if needed installs) Redis, MariaDB and the Kafka-protocol broker
# first, and a 6-node Redis Cluster on loopback, and drops the per-test databases
# an earlier run left behind. Then runs every test, and the reserve, order and
# reconcile tests once more against the Cluster.
set -euo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/.."

scripts/services.sh
scripts/tools.sh
# promtool unpacked by tools.sh, when the machine has none of its own.
export PATH="$PATH:$PWD/.run/tools/usr/bin"
scripts/redis-cluster.sh start

# Each test creates its own database flashsale_t_<uuid>; clear old ones.
stale=$(mariadb -h127.0.0.1 -uroot -N -B -e \
    "SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE 'flashsale\\_t\\_%'")
for db in $stale; do
    mariadb -h127.0.0.1 -uroot -e "DROP DATABASE \`$db\`"
done

# One closing line for the whole run: every libtest summary plus the fault
# suite's own, added up.
log=$(mktemp)
trap 'rm -f "$log" "$log.err" "$log.openapi.json"' EXIT
set +e
cargo test --workspace --locked --no-fail-fast "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [[ $# -eq 0 ]]; then
    echo "== the reserve, order, reconcile, stock-shard, gate, waiting-room, retention and poll tests against the Redis Cluster"
    FLASHSALE_TEST_REDIS_URL="$(scripts/redis-cluster.sh url)" \
        cargo test --workspace --locked --test api -- reserve:: orders:: reconcile:: shards:: gate:: waiting_room:: retention:: polls:: 2>&1 | tee -a "$log"
    cluster_status=${PIPESTATUS[0]}
    [[ $status -ne 0 ]] || status=$cluster_status
    echo "== the deployment files: alert rules and their unit tests (promtool), the dashboard, the Kubernetes manifests, docker-compose.yml (validated, not started), the AsyncAPI document; the broker holds no inherited descriptor"
    passed=0 failed=0
    for check in "promtool check rules deploy/prometheus/alerts.yml" \
                 "promtool test rules deploy/prometheus/alerts_test.yml" \
                 "python3 -m json.tool deploy/grafana/flashsale.json" \
                 ".run/tools-venv/bin/kubernetes-validate --strict deploy/kubernetes/api.yaml deploy/kubernetes/consumer.yaml" \
                 "scripts/compose-check.sh" \
                 "scripts/asyncapi-check.sh" \
                 "scripts/services.sh check-kafka-fds"; do
        if $check >/dev/null 2>"$log.err"; then
            passed=$((passed + 1)); echo "ok: $check"
        else
            failed=$((failed + 1)); echo "FAILED: $check"; cat "$log.err"
        fi
    done
    echo "== the OpenAPI document, linted, and the running API fuzzed against it (schemathesis)"
    if "${CARGO_TARGET_DIR:-target}"/debug/flashsale openapi >"$log.openapi.json" \
        && .run/tools-venv/bin/openapi-spec-validator "$log.openapi.json"; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1)); echo "FAILED: the OpenAPI document does not validate"
    fi
    if scripts/fuzz.sh; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1)); echo "FAILED: scripts/fuzz.sh"
    fi
    echo "deployment checks: $passed passed, $failed failed" | tee -a "$log"
    [[ $failed -eq 0 ]] || status=1
fi
set -e
awk '
    /^test result: / { passed += $4; failed += $6 }
    /^faults: [0-9]+ passed, [0-9]+ failed$/ { passed += $2; failed += $4 }
    /^deployment checks: [0-9]+ passed, [0-9]+ failed$/ { passed += $3; failed += $5 }
    END { printf "tests: %d passed, %d failed\n", passed, failed }
' "$log"
exit "$status"
