"""The span processor that stamps rollout identity and agent name onto every span.

Added to the SDK ``TracerProvider`` by the ``opentelemetry-instrument`` hook
(``spanrl.exporter.hook``) or by ``start_tracing`` (``spanrl.exporter.in_process``). It works
for spans of any instrumentor, ours or not, because it runs when each span starts:

1. the identity in the span's parent context, set by ``rollout()`` or carried in W3C baggage;
2. otherwise the identity in the provider's resource, for one-process-per-rollout runs:
   ``OTEL_RESOURCE_ATTRIBUTES=spanrl.rollout.id=R,spanrl.task.id=T,spanrl.attempt=0``.

Keys a span already has (set by its instrumentor) are left as they are.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from opentelemetry import context as context_api
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider

from spanrl.instrumentation import semconv
from spanrl.instrumentation.rollout import RolloutIdentity, current_agent_name, current_identity

logger = logging.getLogger(__name__)


def identity_from_resource(attributes: Any) -> RolloutIdentity | None:
    """The rollout identity in resource attributes, or None when they name no rollout."""
    if not attributes:
        return None
    rollout_id = attributes.get(semconv.ROLLOUT_ID)
    task_id = attributes.get(semconv.TASK_ID)
    if not rollout_id or not task_id:
        return None
    try:
        attempt = int(attributes.get(semconv.ATTEMPT, 0))
    except (TypeError, ValueError):
        logger.warning("spanrl: resource attribute %s=%r is not an int; using 0",
                       semconv.ATTEMPT, attributes.get(semconv.ATTEMPT))
        attempt = 0
    return RolloutIdentity(str(rollout_id), str(task_id), attempt)


class RolloutIdentitySpanProcessor(SpanProcessor):
    """Copies ``spanrl.rollout.id``, ``spanrl.task.id``, ``spanrl.attempt`` and
    ``spanrl.agent.name`` from the context (or the resource) onto each span as it starts."""

    def __init__(self) -> None:
        # Resources are immutable; parse each one once.
        self._resource_identities: dict[int, RolloutIdentity | None] = {}

    def on_start(self, span: Span, parent_context: context_api.Context | None = None) -> None:
        try:
            self._stamp(span, parent_context)
        except Exception:  # noqa: BLE001 - a processor must never raise into the caller
            logger.exception("spanrl: could not stamp the rollout identity on a span")

    def _stamp(self, span: Span, parent_context: context_api.Context | None) -> None:
        if not span.is_recording():
            return
        identity = current_identity(parent_context) or self._resource_identity(span)
        existing = span.attributes or {}
        if identity is not None:
            for key, value in identity.as_attributes().items():
                if key not in existing:
                    span.set_attribute(key, value)
        agent_name = current_agent_name(parent_context)
        if agent_name is not None and semconv.AGENT_NAME not in existing:
            span.set_attribute(semconv.AGENT_NAME, agent_name)

    def _resource_identity(self, span: Span) -> RolloutIdentity | None:
        resource = span.resource
        key = id(resource)
        if key not in self._resource_identities:
            self._resource_identities[key] = identity_from_resource(resource.attributes)
        return self._resource_identities[key]

    def on_end(self, span: ReadableSpan) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


_providers_with_processor: weakref.WeakSet[TracerProvider] = weakref.WeakSet()


def install_identity_processor(provider: TracerProvider) -> bool:
    """Add the identity processor to ``provider`` once; True when it was added now."""
    if provider in _providers_with_processor:
        return False
    provider.add_span_processor(RolloutIdentitySpanProcessor())
    _providers_with_processor.add(provider)
    return True
