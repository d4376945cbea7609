"""One call, two witnesses: the policy endpoint's own LLM span and the agent side's span of it.

Called by ``assembly._Calls`` once the kept LLM calls of a rollout are known. The endpoint
(``spanrl serve``, the verl gateway) emits a span per request marked ``spanrl.llm.source =
"endpoint"`` (``trainer_bridge/endpoint_spans.py``). When the caller propagated its
``traceparent`` from inside the agent-side LLM span, the endpoint span lies below it and the
nesting rule of ``_Calls`` already keeps one of them. Otherwise (an SDK that sends only the
``x-spanrl-rollout-id`` header) the two are unrelated in the tree: they are the same call when
they carry the same ``gen_ai.response.id`` (the id the endpoint answered with, which the agent
side records). Then the agent-side span stays the call (it sits where the agent's structure,
rewards and agent name are) if it has the engine's token ids; else the endpoint span, which
always has them, is the call.
"""

from __future__ import annotations

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.span_tree import SpanRecord


def is_endpoint_span(record: SpanRecord) -> bool:
    return record.attributes.get(semconv.LLM_SOURCE) == semconv.LLM_SOURCE_ENDPOINT


def _has_token_ids(record: SpanRecord) -> bool:
    attributes = record.attributes
    return semconv.LLM_PROMPT_TOKEN_IDS in attributes or semconv.llm_response_token_ids(0) in attributes


def same_call_by_response_id(kept: list[SpanRecord], merged: dict[str, SpanRecord]) -> dict[str, SpanRecord]:
    """Endpoint spans and agent-side spans of ``kept`` that recorded one call: key of the span
    dropped -> the span kept. Spans already in ``merged`` (dropped for another reason) are passed by."""
    endpoint_by_id: dict[str, SpanRecord] = {}
    agent_side: list[SpanRecord] = []
    for record in kept:
        if record.key in merged:
            continue
        response_id = record.attributes.get(semconv.GENAI_RESPONSE_ID)
        if not isinstance(response_id, str) or not response_id:
            continue
        if is_endpoint_span(record):
            endpoint_by_id.setdefault(response_id, record)
        else:
            agent_side.append(record)
    if not endpoint_by_id:
        return {}
    pairs: dict[str, SpanRecord] = {}
    for agent_span in agent_side:
        endpoint_span = endpoint_by_id.pop(agent_span.attributes[semconv.GENAI_RESPONSE_ID], None)
        if endpoint_span is None:
            continue
        if _has_token_ids(agent_span):
            pairs[endpoint_span.key] = agent_span
        else:
            pairs[agent_span.key] = endpoint_span
    return pairs


__all__ = ["is_endpoint_span", "same_call_by_response_id"]
