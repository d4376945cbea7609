"""LiteLLM's `hosted_vllm/` provider (in `.venv-frameworks`, with OpenTelemetry's httpx and
aiohttp client instrumentations): LiteLLM calls the endpoint with its own HTTP clients (httpx for
`completion`, aiohttp for `acompletion`), not the OpenAI SDK, so the agent side records no ids.
The policy endpoint's own LLM span of each request (exported to the receiver) carries them,
a child of the HTTP client span whose `traceparent` it received: one transition per call,
named by the process's `spanrl.agent.name` resource attribute (LiteLLM names no agents)."""

from __future__ import annotations

import json
from pathlib import Path

from spanrl.instrumentation import semconv
from tests.frameworks.framework_runs import call_span_names, decoded_replies, run_unmodified

HERE = Path(__file__).resolve().parent
VENV_BIN = HERE.parents[1] / ".venv-frameworks" / "bin"


def test_litellm_hosted_vllm_calls_train_through_the_endpoint_spans(serve_policy, receiver):
    server = serve_policy(endpoint_spans=True)
    resource = f"{semconv.ROLLOUT_ID}=litellm-1,{semconv.AGENT_NAME}=solver"
    stdout, rollout = run_unmodified([str(HERE / "agents" / "litellm_agent.py")], server, receiver, "litellm-1",
                                     VENV_BIN, extra_env={"OTEL_RESOURCE_ATTRIBUTES": resource,
                                                          "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert decoded_replies(server, rollout) == json.loads(stdout.strip().splitlines()[-1])
    assert call_span_names(receiver, rollout) == ["POST /v1/chat/completions"] * 2  # the endpoint's spans
    assert [t.agent_name for t in rollout.transitions] == ["solver", "solver"]
