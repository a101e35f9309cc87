#!/usr/bin/env bash
# Install the command-line tools the tests use besides the services, when missing:
#
#   promtool             checks the metrics output and the alert rules (unpacked
#                        from Debian's prometheus package into .run/tools)
#   kubernetes-validate  checks the Kubernetes manifests offline against the API
#                        schemas it bundles (PyPI, into .run/tools-venv)
#   chromium, chromedriver  the operators' page's browser test (Debian's chromium
#                        and chromium-driver packages)
#   schemathesis, openapi-spec-validator  the API fuzzed against its OpenAPI
#                        document, and the document linted (PyPI, .run/tools-venv)
#   docker-compose       validates docker-compose.yml (`scripts/compose-check.sh`);
#                        Debian's package, without the engine it recommends:
#                        `docker-compose config` needs none, and nothing here
#                        starts a container
#   faketime             the fault suite runs service instances under a skewed
#                        clock with its library, libfaketime (Debian's faketime
#                        package; `tests/faults/scenarios/clock_skewed.rs`)
#   asyncapi             validates docs/asyncapi.yaml (`scripts/asyncapi-check.sh`):
#                        the AsyncAPI Initiative's own parser, @asyncapi/parser,
#                        from the npm registry into .run/tools-node, run by the
#                        machine's Node.js (Debian's nodejs and npm when missing)
#
# Idempotent; prints one line per tool. With arguments, only the tools named:
# promtool, python (the PyPI tools), chromium, docker-compose, faketime, asyncapi
# (`scripts/tools.sh faketime`, as `scripts/faults-loop.sh` runs it).
set -euo pipefail

as_root() {
    if [[ $EUID -eq 0 ]]; then "$@"; else sudo "$@"; fi
}

REPO_ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)"

# promtool comes out of Debian's prometheus package unpacked into .run/tools,
# never installed: installing the package would start a Prometheus server, and
# the tests must not start, stop or disable anything on the machine. A promtool
# already on PATH is used as it is.
TOOLS="$REPO_ROOT/.run/tools"
promtool_tool() {
    if command -v promtool >/dev/null 2>&1; then
        echo "tools: promtool $(promtool --version 2>&1 | head -1 | awk '{print $3}') present"
    elif [[ -x "$TOOLS/usr/bin/promtool" ]]; then
        echo "tools: promtool $("$TOOLS/usr/bin/promtool" --version 2>&1 | head -1 | awk '{print $3}') present in .run/tools"
    else
        echo "tools: unpacking promtool from Debian's prometheus package into .run/tools"
        as_root apt-get update -qq
        debs=$(mktemp -d)
        chown _apt "$debs" 2>/dev/null || true  # apt downloads as _apt where it can
        (cd "$debs" && apt-get download -qq prometheus)
        mkdir -p "$TOOLS"
        dpkg-deb -x "$debs"/prometheus_*.deb "$TOOLS"
        rm -rf "$debs"
        echo "tools: promtool $("$TOOLS/usr/bin/promtool" --version 2>&1 | head -1 | awk '{print $3}') unpacked"
    fi
}

VENV="$REPO_ROOT/.run/tools-venv"
PYTHON_TOOLS=(kubernetes-validate==1.37.0 schemathesis==4.32.5 openapi-spec-validator==0.9.0)
python_tools() {
    for req in "${PYTHON_TOOLS[@]}"; do
        name=${req%%==*} version=${req##*==}
        installed="$("$VENV/bin/pip" show "$name" 2>/dev/null || true)"
        if [[ "$installed" == *"Version: $version"* ]]; then
            echo "tools: $name $version present"
        else
            echo "tools: installing $name $version into .run/tools-venv"
            [[ -x "$VENV/bin/pip" ]] || python3 -m venv "$VENV"
            "$VENV/bin/pip" install --quiet --disable-pip-version-check "$req"
        fi
    done
}

chromium_tool() {
    if command -v chromedriver >/dev/null 2>&1 && command -v chromium >/dev/null 2>&1; then
        echo "tools: chromium and chromedriver present"
    else
        echo "tools: installing chromium and chromedriver (Debian packages chromium, chromium-driver)"
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
            chromium chromium-driver >/dev/null
        echo "tools: $(chromedriver --version | head -1) installed"
    fi
}

docker_compose_tool() {
    if command -v docker-compose >/dev/null 2>&1; then
        echo "tools: docker-compose $(docker-compose version --short 2>/dev/null) present"
    else
        echo "tools: installing docker-compose (Debian package docker-compose, no engine)"
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
            docker-compose >/dev/null
        echo "tools: docker-compose $(docker-compose version --short) installed"
    fi
}

# The package brings the `faketime` command and its library; the fault suite
# preloads the library into the process it skews (the command would run the
# service as its child, out of reach of the suite's kill and pause).
faketime_version() {
    faketime --version 2>&1 | awk '/Version/ {print $3}'
}
faketime_tool() {
    if command -v faketime >/dev/null 2>&1; then
        echo "tools: faketime $(faketime_version) present"
    else
        echo "tools: installing faketime (Debian package faketime)"
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
            faketime >/dev/null
        echo "tools: faketime $(faketime_version) installed"
    fi
}

NODE_TOOLS="$REPO_ROOT/.run/tools-node"
ASYNCAPI_PARSER=3.6.6
asyncapi_tool() {
    if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
        echo "tools: installing Node.js (Debian packages nodejs, npm)"
        as_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
            nodejs npm >/dev/null
    fi
    local manifest="$NODE_TOOLS/node_modules/@asyncapi/parser/package.json"
    local installed
    installed="$(MANIFEST="$manifest" node -p 'require(process.env.MANIFEST).version' 2>/dev/null || true)"
    if [[ "$installed" == "$ASYNCAPI_PARSER" ]]; then
        echo "tools: @asyncapi/parser $installed present in .run/tools-node"
    else
        echo "tools: installing @asyncapi/parser $ASYNCAPI_PARSER into .run/tools-node"
        mkdir -p "$NODE_TOOLS"
        npm install --prefix "$NODE_TOOLS" --no-audit --no-fund --silent \
            "@asyncapi/parser@$ASYNCAPI_PARSER"
        echo "tools: @asyncapi/parser $(MANIFEST="$manifest" node -p 'require(process.env.MANIFEST).version') installed"
    fi
}

wanted=("$@")
[[ ${#wanted[@]} -gt 0 ]] || wanted=(promtool python chromium docker-compose faketime asyncapi)
for tool in "${wanted[@]}"; do
    case "$tool" in
        promtool) promtool_tool ;;
        python) python_tools ;;
        chromium) chromium_tool ;;
        docker-compose) docker_compose_tool ;;
        faketime) faketime_tool ;;
        asyncapi) asyncapi_tool ;;
        *)
            echo "tools: no tool $tool (promtool, python, chromium, docker-compose, faketime, asyncapi)" >&2
            exit 2
            ;;
    esac
done
