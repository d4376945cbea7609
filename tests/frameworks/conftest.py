"""Agent frameworks in their own venvs, and the OpenAI Agents SDK's own example programs.

`.ci/frameworks_env.sh` builds one venv per set of frameworks whose pins agree (this repository
installed plainly, as in a user's agent environment, plus the frameworks) and unpacks the Agents
SDK's sdist; each agent runs with its venv's `opentelemetry-instrument`, while the policy server
and `spanrl receive` run here, in the main environment. CI builds them after the main suite:

    bash .ci/frameworks_env.sh && python -m pytest -q tests/frameworks

A module is collected only once what it needs is fully built (the build writes `.spanrl-ready`
last; the main suite's run, before the build, collects none); nothing here is skipped where it runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spanrl.child_processes import free_port
from spanrl.trainer_bridge.endpoint_spans import SPANS_ENDPOINT_ENV
from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread
from tests.integration.conftest import (  # noqa: F401  (policy_server, receiver: the shared fixtures)
    TEST_DEVICE,
    RecordingPolicyEngine,
    policy_server,
    receiver,
)

REPO = Path(__file__).resolve().parents[2]
READY = ".spanrl-ready"  # written last by .ci/frameworks_env.sh
AGENTS_SDK_VERSION = next(line.split("==", 1)[1].split()[0]
                          for line in (REPO / ".ci" / "requirements-ci.txt").read_text().splitlines()
                          if line.startswith("openai-agents=="))
AGENTS_SDK_SDIST = REPO / ".framework-examples" / f"openai_agents-{AGENTS_SDK_VERSION}"
NEEDS = {
    "test_frameworks_autogen.py": REPO / ".venv-autogen",
    "test_frameworks_crewai.py": REPO / ".venv-crewai",
    "test_frameworks_agent_framework.py": REPO / ".venv-frameworks",
    "test_frameworks_google_adk.py": REPO / ".venv-frameworks",
    "test_frameworks_pydantic_ai.py": REPO / ".venv-frameworks",
    "test_frameworks_smolagents.py": REPO / ".venv-frameworks",
    "test_frameworks_litellm.py": REPO / ".venv-frameworks",
    "test_frameworks_llama_index.py": REPO / ".venv-llamaindex",
    "test_frameworks_calc_autogen_training.py": REPO / ".venv-autogen",
    "test_frameworks_agents_sdk_examples.py": AGENTS_SDK_SDIST,
}

collect_ignore = [module for module, built in NEEDS.items() if not (built / READY).exists()]

# Room for real agents' prompts: with the tiny preset's 384-token vocabulary, smolagents'
# CodeAgent system prompt alone is about 6,700 tokens (1,024 is the preset's context).
CONTEXT_TOKENS = 8192


@pytest.fixture(scope="session")
def roomy_model_dir(tmp_path_factory) -> Path:
    """The tiny preset (random weights) with a context of CONTEXT_TOKENS: its positions are
    rotary, so only the configured length changes."""
    model_dir = create_model_dir(tmp_path_factory.mktemp("roomy") / "model", preset="tiny", seed=0)
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        path = model_dir / name
        settings = json.loads(path.read_text())
        settings[key] = CONTEXT_TOKENS
        path.write_text(json.dumps(settings, indent=2) + "\n")
    return model_dir


@pytest.fixture
def serve_policy(roomy_model_dir, receiver, monkeypatch):  # noqa: F811  (receiver: the shared fixture)
    """``serve_policy(model_name, endpoint_spans=False)``: the embedded policy server on a free
    port, its engine recording every request; with ``endpoint_spans`` it exports its own LLM
    span of each request to ``receiver`` (docs/instrumentation.md)."""
    servers = []

    def serve(model_name: str = "policy", endpoint_spans: bool = False):
        if endpoint_spans:
            monkeypatch.setenv(SPANS_ENDPOINT_ENV, receiver["grpc"])
        else:
            monkeypatch.setenv(SPANS_ENDPOINT_ENV, "off")
        engine = RecordingPolicyEngine.from_pretrained(roomy_model_dir, device=TEST_DEVICE, model_name=model_name)
        servers.append(serve_in_thread(engine, port=free_port()))
        return servers[-1]

    yield serve
    for server in servers:
        server.stop()
