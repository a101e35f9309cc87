#!/usr/bin/env bash
# Validates docker-compose.yml without a container engine: Debian's
# docker-compose 1.29 (installed by scripts/tools.sh) parses, interpolates and
# checks the file against the compose schema (`docker-compose config`), which
# needs no engine. Nothing is pulled, built or started.
#
#   scripts/compose-check.sh     # exit 0 and one line when the file is good
#
# Checks, each naming what broke on failure:
#   - the file is valid as a user with a fresh clone has it: no variable set;
#   - `docker compose up` brings up exactly Redis, MariaDB (`mysql`) and the
#     Kafka broker, on the host ports config/default.toml uses;
#   - with the two secrets set, the `app` profile adds the service.
set -euo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/.."

fail() {
    echo "compose-check: FAILED: $*" >&2
    exit 1
}

command -v docker-compose >/dev/null 2>&1 \
    || fail "docker-compose is missing; scripts/tools.sh installs it (Debian package docker-compose)"

# The environment of a user who set nothing: none of the file's variables.
compose() {
    env -u FLASHSALE_ADMIN_TOKEN -u FLASHSALE_USER_TOKEN_SECRET \
        docker-compose --ansi never -f docker-compose.yml "$@" 2>&1
}

out=$(compose config -q) || fail "docker-compose.yml does not validate:
$out"
[[ -z "$out" ]] || fail "docker-compose config warns:
$out"

# What `docker compose up` starts: the services outside any profile, read
# from the resolved file (python3-yaml comes with docker-compose).
resolved=$(compose config)
summary=$(python3 -c '
import sys, yaml
doc = yaml.safe_load(sys.stdin)
for name, svc in sorted(doc["services"].items()):
    ports = " ".join(str(p["published"]) for p in svc.get("ports", []))
    print(name, ",".join(svc.get("profiles", [])) or "-", ports)
' <<<"$resolved") || fail "the resolved file does not read as YAML"
default=$(awk '$2 == "-" { print $1 }' <<<"$summary" | tr '\n' ' ')
[[ "$default" == "kafka mysql redis " ]] \
    || fail "docker compose up should start kafka, mysql and redis, not: $default"
for port in 6379 3306 9092; do
    grep -q "127.0.0.1:$port" config/default.toml \
        || fail "config/default.toml no longer uses port $port; update this check and docker-compose.yml together"
    awk -v p="$port" '$2 == "-" { for (i = 3; i <= NF; i++) if ($i == p) found = 1 } END { exit !found }' <<<"$summary" \
        || fail "no service of docker compose up publishes host port $port (config/default.toml's)"
done
grep -qx "app app 8080" <<<"$summary" || fail "the service should be in the app profile on port 8080: $summary"

with_app=$(FLASHSALE_ADMIN_TOKEN=compose-check-admin-token \
    FLASHSALE_USER_TOKEN_SECRET=compose-check-user-secret \
    docker-compose --ansi never -f docker-compose.yml --profile app config -q 2>&1) \
    || fail "docker-compose.yml does not validate with the app profile and its secrets:
$with_app"

echo "compose-check: docker-compose.yml is valid (docker-compose $(docker-compose version --short)): up starts ${default% }; profile app adds the service"
