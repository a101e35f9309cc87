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

cargo test --workspace --locked "$@"
