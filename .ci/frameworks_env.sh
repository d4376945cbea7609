#!/usr/bin/env bash
# Builds one venv per agent framework whose pins clash with the main test environment:
# .venv-autogen (autogen-agentchat pins protobuf 5.29) and .venv-crewai (crewai's own pins).
# Each is what a user's agent environment is: this repository installed plainly (no extras)
# plus the framework. tests/frameworks runs agents with these venvs' `opentelemetry-instrument`
# (the policy server and receiver run in the main environment), after the main suite:
#
#     bash .ci/frameworks_env.sh && python -m pytest -q tests/frameworks
#
# Pip's cache is reused between builds; each build prints how long it took (measured here on the
# 2-core machine: .venv-autogen 43 s, .venv-crewai 108 s with the machine shared by other builds;
# 217 s and 479 s under a load of 12).
set -euo pipefail
cd "$(dirname "$0")/.."

build() {
    local name=$1
    shift
    local started=$SECONDS
    python3 -m venv ".venv-$name"
    ".venv-$name/bin/python" -m pip install -q -U pip setuptools wheel
    ".venv-$name/bin/python" -m pip install -q -e . "$@"
    echo "frameworks_env: .venv-$name built in $((SECONDS - started)) s"
}

build autogen "autogen-agentchat==0.7.5" "autogen-ext[openai]==0.7.5"
build crewai "crewai==1.15.30" "openinference-instrumentation-crewai==1.1.21"
