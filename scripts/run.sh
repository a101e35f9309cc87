#!/usr/bin/env bash
# Sets everything up on this machine and runs the service in the foreground:
# services (Redis, MariaDB, the Kafka-protocol broker) → release build →
# `flashsale migrate` → `flashsale serve` on 127.0.0.1:8080. Ctrl-C stops it
# gracefully. The services keep running afterwards.
set -euo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/.."

scripts/services.sh
cargo build --release --locked
"${CARGO_TARGET_DIR:-target}"/release/flashsale migrate
# The local broker is tansu, whose idempotent-producer support is broken (see
# config/test.toml); the consumer absorbs duplicates.
export FLASHSALE__KAFKA__IDEMPOTENCE="${FLASHSALE__KAFKA__IDEMPOTENCE:-false}"
exec "${CARGO_TARGET_DIR:-target}"/release/flashsale serve
