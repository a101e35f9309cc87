#!/usr/bin/env bash
# Runs the whole test suite against real services on loopback.
#
#   scripts/test.sh            # everything
#   scripts/test.sh seed_test  # extra arguments go to `cargo test` (a name filter)
#
# Starts (and if needed installs) Redis, MariaDB and the Kafka-protocol broker
# first, and drops the per-test databases an earlier run left behind.
set -euo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/.."

scripts/services.sh

# Each test creates its own database flashsale_t_<uuid>; clear old ones.
stale=$(mariadb -h127.0.0.1 -uroot -N -B -e \
    "SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE 'flashsale\\_t\\_%'")
for db in $stale; do
    mariadb -h127.0.0.1 -uroot -e "DROP DATABASE \`$db\`"
done

# One closing line for the whole run: every libtest summary plus the fault
# suite's own, added up.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
cargo test --workspace --locked "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
awk '
    /^test result: / { passed += $4; failed += $6 }
    /^faults: [0-9]+ passed, [0-9]+ failed$/ { passed += $2; failed += $4 }
    END { printf "tests: %d passed, %d failed\n", passed, failed }
' "$log"
exit "$status"
