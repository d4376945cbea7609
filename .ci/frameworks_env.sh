#!/usr/bin/env bash
# Builds the agent environments of tests/frameworks, one venv per set of frameworks whose pins
# agree (each is what a user's agent environment is: this repository installed plainly, no
# extras, plus the frameworks), and fetches the OpenAI Agents SDK's own example programs:
#
#   .venv-autogen      autogen-agentchat (pins protobuf 5.29, below the main environment's)
#   .venv-crewai       crewai (its own pins)
#   .venv-frameworks   Microsoft Agent Framework, Google ADK, PydanticAI, smolagents, LiteLLM
#                      (google-adk caps OpenTelemetry at 1.44; pydantic-ai needs openai>=3.31)
#   .venv-llamaindex   LlamaIndex (llama-index-llms-openai pins openai<3)
#   .framework-examples/openai_agents-<version>/   the sdist of the openai-agents version
#                      .ci/requirements-ci.txt pins, unpacked (its examples/ run unmodified)
#
# The builds run side by side and reuse the installer's cache; each writes `.spanrl-ready` last, which
# tests/frameworks/conftest.py waits for before it collects the framework's tests. Then:
#
#     bash .ci/frameworks_env.sh && .venv/bin/python -m pytest -q tests/frameworks
#
# Each step prints how long it took; a failed step prints its log and fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/install.sh  # ci_install: uv when .ci/run provides it ($SPANRL_CI_UV), else pip
READY=.spanrl-ready
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT

build() {
    local name=$1
    shift
    local started=$SECONDS
    rm -f ".venv-$name/$READY"
    python3 -m venv ".venv-$name"
    ci_install ".venv-$name/bin/python" -U pip setuptools wheel
    ci_install ".venv-$name/bin/python" -e . "$@"
    touch ".venv-$name/$READY"
    echo "frameworks_env: .venv-$name built in $((SECONDS - started)) s"
}

fetch_agents_sdk_examples() {
    local started=$SECONDS
    local version
    version=$(sed -n 's/^openai-agents==\([^ #]*\).*/\1/p' .ci/requirements-ci.txt)
    [ -n "$version" ] || { echo "no openai-agents==VERSION in .ci/requirements-ci.txt" >&2; return 1; }
    local target=.framework-examples/openai_agents-$version
    rm -f "$target/$READY"
    mkdir -p .framework-examples
    python3 -m pip download -q --no-binary :all: --no-deps -d .framework-examples "openai-agents==$version"
    tar -xzf ".framework-examples/openai_agents-$version.tar.gz" -C .framework-examples
    touch "$target/$READY"
    echo "frameworks_env: $target fetched in $((SECONDS - started)) s"
}

step() {  # run "$@" in the background, its output in $LOGS/<name>
    local name=$1
    shift
    "$@" >"$LOGS/$name" 2>&1 &
    pids+=("$!:$name")
}

pids=()
step autogen build autogen "autogen-agentchat==0.7.5" "autogen-ext[openai]==0.7.5"
step crewai build crewai "crewai==1.15.30" "openinference-instrumentation-crewai==1.1.21"
step frameworks build frameworks \
    "agent-framework-core==1.23.0" "agent-framework-openai==1.17.0" \
    "google-adk==2.13.0" "litellm==1.110.2" "pydantic-ai-slim[openai]==2.68.0" \
    "smolagents[openai]==1.26.0" "openinference-instrumentation-smolagents==0.1.43" \
    "opentelemetry-instrumentation-httpx==0.65b0" "opentelemetry-instrumentation-aiohttp-client==0.65b0"
# [instruments]: opentelemetry-instrument loads openinference's LlamaIndex instrumentor only when
# every package of that extra is installed (it lists llama-index-multi-modal-llms-openai, which
# caps llama-index-llms-openai below 0.7, hence llama-index-llms-openai-like 0.7.0).
step llamaindex build llamaindex \
    "llama-index-core==0.14.25" "llama-index-llms-openai-like==0.7.0" \
    "openinference-instrumentation-llama-index[instruments]==4.6.1"
step examples fetch_agents_sdk_examples

failed=0
for entry in "${pids[@]}"; do
    name=${entry#*:}
    if wait "${entry%%:*}"; then
        grep "^frameworks_env:" "$LOGS/$name" || true
    else
        failed=1
        echo "frameworks_env: $name failed:" >&2
        grep -v "^WARNING: Location" "$LOGS/$name" | tail -40 >&2
    fi
done
exit $failed
