"""Zero-code instrumentation of the OpenAI Python SDK for RL: token ids on openinference's LLM span.

Loaded by ``opentelemetry-instrument`` through the ``opentelemetry_instrumentor`` entry point
``spanrl_openai`` (or called by ``spanrl.exporter.in_process.start_tracing``). It builds on
openinference's ``OpenAIInstrumentor``, which makes one LLM span per call (and is turned on here
if it is not already), and adds only what RL needs, on that same span (``sdk_calls``: how):

- the request asks the endpoint for token ids, unless ``OTEL_SPANRL_REQUEST_TOKEN_IDS=false``,
  with vLLM's field for the route: ``return_token_ids: true`` on chat/completions and
  completions, ``enable_response_messages: true`` on responses; an endpoint that ignores the
  field still works (never sent to api.openai.com, which refuses unknown fields);
- ``spanrl.llm.prompt_token_ids``, ``spanrl.llm.response.<i>.token_ids``, logprobs when
  present, ``spanrl.llm.policy_version`` and ``gen_ai.response.id``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from spanrl.instrumentation import semconv
from spanrl.instrumentation.package import _instruments
from spanrl.instrumentation.sdk_calls import (
    SdkCalls,
    SdkTokenIdInstrumentor,
    auto_instrumentation_started,
    ensure_openinference_after_auto,
)

OPENAI_CALLS = SdkCalls(
    sdk="OpenAI", base_client_module="openai._base_client",
    span_scopes=("openinference.instrumentation.openai",),
    token_id_flags=(("/chat/completions", semconv.REQUEST_RETURN_TOKEN_IDS),
                    ("/completions", semconv.REQUEST_RETURN_TOKEN_IDS),
                    ("/responses", semconv.REQUEST_ENABLE_RESPONSE_MESSAGES)),
    strict_hosts=("api.openai.com",))


class SpanrlOpenAIInstrumentor(SdkTokenIdInstrumentor):
    """Adds engine token ids and the policy version to openinference's OpenAI LLM spans."""

    calls = OPENAI_CALLS

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def openinference(self) -> Any:
        from openinference.instrumentation.openai import OpenAIInstrumentor

        return OpenAIInstrumentor()


__all__ = ["OPENAI_CALLS", "SpanrlOpenAIInstrumentor", "auto_instrumentation_started",
           "ensure_openinference_after_auto"]
