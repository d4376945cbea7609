"""Zero-code instrumentation of Anthropic's Python SDK for RL: token ids on openinference's LLM span.

Loaded by ``opentelemetry-instrument`` through the ``opentelemetry_instrumentor`` entry point
``spanrl_anthropic`` (or called by ``spanrl.exporter.in_process.start_tracing``), where the
``anthropic`` package is installed. It builds on openinference's ``AnthropicInstrumentor``
(``openinference-instrumentation-anthropic``, a spanrl dependency), which makes one LLM span per
``messages.create`` / ``messages.stream`` call, and adds what RL needs on that span, as
``openai_instrumentor`` does for OpenAI's SDK (the two SDKs share their generated client:
``sdk_calls``): ``return_token_ids: true`` on ``POST /v1/messages`` (spanrl's endpoints answer with
the engine's ids; never sent to api.anthropic.com), the ``x-spanrl-rollout-id`` header, and the
ids, policy version and ``gen_ai.response.id`` of the reply on the call's span. The SDK (2.x) also
sends the W3C ``traceparent`` of its own span of the call, so an endpoint's span of the call
(``spanrl.llm.source = "endpoint"``) nests under the agent's and the receiver keeps one transition.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from spanrl.instrumentation import semconv
from spanrl.instrumentation.package import _instruments_anthropic
from spanrl.instrumentation.sdk_calls import SdkCalls, SdkTokenIdInstrumentor

ANTHROPIC_CALLS = SdkCalls(
    sdk="Anthropic", base_client_module="anthropic._base_client",
    # anthropic >= 2 makes its own span of each call ("anthropic.messages.create"), current inside
    # openinference's while the response is read: the ids go on it (a child of openinference's, with
    # gen_ai.response.id), so the receiver keeps one call; older SDKs: on openinference's span
    span_scopes=("openinference.instrumentation.anthropic", "com.anthropic.sdk.python"),
    token_id_flags=(("/v1/messages", semconv.REQUEST_RETURN_TOKEN_IDS),),
    strict_hosts=("api.anthropic.com",))


class SpanrlAnthropicInstrumentor(SdkTokenIdInstrumentor):
    """Adds engine token ids and the policy version to openinference's Anthropic LLM spans."""

    calls = ANTHROPIC_CALLS

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments_anthropic

    def openinference(self) -> Any:
        from openinference.instrumentation.anthropic import AnthropicInstrumentor

        return AnthropicInstrumentor()


__all__ = ["ANTHROPIC_CALLS", "SpanrlAnthropicInstrumentor"]
