#!/usr/bin/env bash
# Validates docs/asyncapi.yaml (the Kafka topics, described as AsyncAPI 3)
# with the AsyncAPI Initiative's own parser, which scripts/tools.sh installs
# into .run/tools-node: the document must parse and validate with no error.
# Prints every diagnostic it has, warnings included, on stderr. Each message's
# examples must match its payload schema, and so must each payload file named
# after a message (the API tests pass the messages the service really
# publishes). Paths are taken from the caller's directory.
#
#   scripts/asyncapi-check.sh                          # docs/asyncapi.yaml
#   scripts/asyncapi-check.sh FILE [MESSAGE PAYLOAD.json]...
set -euo pipefail
REPO_ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)"
TOOLS="$REPO_ROOT/.run/tools-node"
[[ -d "$TOOLS/node_modules/@asyncapi/parser" ]] \
    || { echo "asyncapi-check: the parser is missing: run scripts/tools.sh asyncapi" >&2; exit 2; }
doc="${1:-$REPO_ROOT/docs/asyncapi.yaml}"
shift $(( $# > 0 ? 1 : 0 ))
exec node "$REPO_ROOT/scripts/asyncapi-check.mjs" "$TOOLS" "$doc" "$@"
