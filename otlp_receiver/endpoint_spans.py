"""One call, two witnesses: the policy endpoint's own LLM span and the agent side's span of it.

Called by ``assembly._Calls`` once the kept LLM calls of a rollout are known. The endpoint
(``spanrl serve``, the verl gateway) emits a span per request marked ``spanrl.llm.source =
"endpoint"`` (``trainer_bridge/endpoint_spans.py``). When the caller propagated its
``traceparent`` from inside the agent-side LLM span, the endpoint span lies below it and the
nesting rule of ``_Calls`` already keeps one of them. Otherwise (an SDK that sends only the
``x-spanrl-rollout-id`` header) the two are unrelated in the tree: they are the same call when
they carry the same ``gen_ai.response.id`` (the id the endpoint answered with, which the agent
side records). Then the endpoint span is the call: its token ids are what the engine saw and
sampled, while the agent's process could record any ids (docs/trust.md). The agent-side span is
merged into it, so rewards and agent names found at the agent's span still reach the call.

Where both records of a call carry token ids and they differ (``token_id_mismatches``, also for an
endpoint span nested under the agent's span, where ``_Calls`` keeps the inner one), the
endpoint's are used and the mismatch is counted (``spanrl.schema.rollouts.COUNTER_TOKEN_ID_MISMATCHES``).
"""

from __future__ import annotations

from collections.abc import Iterable

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.span_tree import SpanRecord, token_ids_of


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
        if endpoint_span is not None:
            pairs[agent_span.key] = endpoint_span
    return pairs


def token_id_mismatches(spans_with_ids: Iterable[SpanRecord]) -> list[tuple[SpanRecord, SpanRecord]]:
    """``(agent-side span, endpoint span)`` pairs of one call (the same ``gen_ai.response.id``)
    whose token ids differ; ``spans_with_ids`` are a rollout's LLM spans that carry ids."""
    endpoint_by_id: dict[str, SpanRecord] = {}
    agent_side: list[tuple[str, SpanRecord]] = []
    for record in spans_with_ids:
        response_id = record.attributes.get(semconv.GENAI_RESPONSE_ID)
        if not isinstance(response_id, str) or not response_id:
            continue
        if is_endpoint_span(record):
            endpoint_by_id.setdefault(response_id, record)
        else:
            agent_side.append((response_id, record))
    return [(agent_span, endpoint_by_id[response_id]) for response_id, agent_span in agent_side
            if response_id in endpoint_by_id and _token_ids(agent_span) != _token_ids(endpoint_by_id[response_id])]


def _token_ids(record: SpanRecord) -> tuple[list | None, list[list | None]]:
    """The prompt ids and every choice's response ids a span recorded."""
    attributes = record.attributes
    responses = []
    choice = 0
    while semconv.llm_response_token_ids(choice) in attributes:
        responses.append(token_ids_of(attributes[semconv.llm_response_token_ids(choice)]))
        choice += 1
    return token_ids_of(attributes.get(semconv.LLM_PROMPT_TOKEN_IDS)), responses


__all__ = ["is_endpoint_span", "same_call_by_response_id", "token_id_mismatches"]
