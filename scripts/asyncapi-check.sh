#!/usr/bin/env bash
# Validates docs/asyncapi.yaml (the Kafka topics, described as AsyncAPI 3)
# with the AsyncAPI Initiative's own parser, which scripts/tools.sh installs
# into .run/tools-node: the document must parse and validate with no error.
# Prints every diagnostic it has, warnings included. Each message's examples
# must match its payload schema, and so must each payload file named after a
# message (the API tests pass the messages the service really publishes).
#
#   scripts/asyncapi-check.sh                          # docs/asyncapi.yaml
#   scripts/asyncapi-check.sh FILE [MESSAGE PAYLOAD.json]...
set -euo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/.."
doc="${1:-docs/asyncapi.yaml}"
shift $(( $# > 0 ? 1 : 0 ))
exec node scripts/asyncapi-check.mjs "$PWD/.run/tools-node" "$doc" "$@"
