"""Tracing set up from Python, for agents that run inside another program (the runner).

``start_tracing()`` gives the process what ``opentelemetry-instrument`` would: an SDK tracer
provider exporting over OTLP (batch), the rollout-identity processor, the safe defaults, and
the OpenAI SDK instrumented (openinference + spanrl). ``stop_tracing()`` flushes and shuts the
exporter down. OTel allows one global tracer provider per process, so a provider that is
already installed (by ``opentelemetry-instrument`` or an earlier ``start_tracing``) is reused
and given spanrl's processors instead of being replaced; ``tracer_provider=`` sets up a
provider of the caller's instead and leaves the global one alone (pass the same provider to
``rollout()`` and the runner).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

from opentelemetry import trace as trace_api
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from spanrl.exporter import environment_variables as env
from spanrl.exporter import safe_defaults
from spanrl.exporter.span_processor import install_identity_processor
from spanrl.instrumentation.settings import InstrumentationSettings

logger = logging.getLogger(__name__)

DEFAULT_GRPC_ENDPOINT = "http://127.0.0.1:4317"
DEFAULT_HTTP_ENDPOINT = "http://127.0.0.1:4318"
PROTOCOLS = ("grpc", "http/protobuf")


@dataclass
class _Tracing:
    provider: TracerProvider
    export_processor: SpanProcessor
    instrumentor: object | None


_lock = threading.Lock()
_active: _Tracing | None = None


def start_tracing(
    endpoint: str | None = None,
    *,
    protocol: str = "grpc",
    instrument_openai: bool = True,
    service_name: str = "spanrl-agent",
    headers: Mapping[str, str] | None = None,
    tracer_provider: TracerProvider | None = None,
) -> TracerProvider:
    """Export this process's spans over OTLP to ``endpoint`` (default:
    ``OTEL_EXPORTER_OTLP_ENDPOINT``, else 127.0.0.1:4317 for gRPC / :4318 for HTTP).

    ``headers`` go with every export; ``OTEL_SPANRL_RECEIVER_TOKEN`` adds
    ``authorization: Bearer <token>`` unless ``headers`` has an authorization already.
    ``tracer_provider``: set up this SDK provider (default: the global one, created if there
    is none). Calling it again while tracing is on returns the same provider."""
    global _active
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    with _lock:
        if _active is not None:
            logger.warning("spanrl: start_tracing called twice; keeping the first set-up")
            return _active.provider
        endpoint = endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or (
            DEFAULT_GRPC_ENDPOINT if protocol == "grpc" else DEFAULT_HTTP_ENDPOINT
        )
        export_headers = headers_with_token(headers)
        provider = tracer_provider if tracer_provider is not None else _global_sdk_provider(service_name)
        install_identity_processor(provider)
        if InstrumentationSettings.from_env().safe_defaults:
            safe_defaults.raise_attribute_count_limit(provider)
            safe_defaults.sample_everything(provider)
        export_processor = BatchSpanProcessor(span_exporter(endpoint, protocol, export_headers))
        provider.add_span_processor(export_processor)
        instrumentor = _instrument_openai(provider) if instrument_openai else None
        _active = _Tracing(provider, export_processor, instrumentor)
        logger.info("spanrl: tracing to %s over %s (service %s)", endpoint, protocol, service_name)
        return provider


def stop_tracing(timeout_millis: int = 30000) -> None:
    """Flush the spans not yet exported, stop exporting, and undo the OpenAI instrumentation."""
    global _active
    with _lock:
        tracing, _active = _active, None
    if tracing is None:
        return
    if tracing.instrumentor is not None:
        try:
            tracing.instrumentor.uninstrument()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001
            logger.exception("spanrl: could not uninstrument the OpenAI SDK")
    try:
        tracing.export_processor.force_flush(timeout_millis)
    finally:
        tracing.export_processor.shutdown()


def headers_with_token(headers: Mapping[str, str] | None) -> dict[str, str]:
    """``headers`` (lower-cased) plus ``authorization: Bearer`` from ``OTEL_SPANRL_RECEIVER_TOKEN``."""
    result = {str(k).lower(): str(v) for k, v in (headers or {}).items()}
    token = os.environ.get(env.OTEL_SPANRL_RECEIVER_TOKEN, "").strip()
    if token and "authorization" not in result:
        result["authorization"] = f"Bearer {token}"
    return result


def _global_sdk_provider(service_name: str) -> TracerProvider:
    """The global SDK provider, created (and made global) when there is none."""
    current = trace_api.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    # OTEL_SERVICE_NAME (read by Resource.create) wins over our default name.
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    trace_api.set_tracer_provider(provider)
    if trace_api.get_tracer_provider() is not provider:
        raise RuntimeError(
            f"a non-SDK global tracer provider ({type(current).__name__}) is already set; "
            "spanrl needs the OTel SDK's TracerProvider"
        )
    return provider


def span_exporter(endpoint: str, protocol: str, headers: dict[str, str], timeout_s: float | None = None):
    """An OTLP span exporter for ``endpoint`` over ``protocol`` (``grpc`` or ``http/protobuf``)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )

        insecure = urlparse(endpoint).scheme != "https"
        return OTLPSpanExporter(endpoint=endpoint, insecure=insecure, headers=headers or None, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
        OTLPSpanExporter as HTTPSpanExporter,
    )

    if urlparse(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HTTPSpanExporter(endpoint=endpoint, headers=headers or None, timeout=timeout_s)


def _instrument_openai(provider: TracerProvider) -> object | None:
    try:
        from spanrl.instrumentation.openai_instrumentor import (  # noqa: PLC0415
            SpanrlOpenAIInstrumentor,
        )
    except ImportError as exc:
        logger.warning("spanrl: OpenAI SDK instrumentation unavailable: %s", exc)
        return None
    instrumentor = SpanrlOpenAIInstrumentor()
    if instrumentor.is_instrumented_by_opentelemetry:
        return None  # someone else (opentelemetry-instrument) owns it
    instrumentor.instrument(tracer_provider=provider)
    return instrumentor if instrumentor.is_instrumented_by_opentelemetry else None
