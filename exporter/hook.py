"""``opentelemetry-instrument`` hooks: prepare the distro's tracer provider for spanrl.

Entry points ``opentelemetry_pre_instrument`` -> ``pre_instrument`` and
``opentelemetry_post_instrument`` -> ``post_instrument`` (see pyproject.toml). The
auto-instrumentation start-up runs, in order: the distro (sets the exporters' defaults), the
SDK configurator (builds the tracer, meter and logger providers), pre-instrument hooks,
instrumentors, post-instrument hooks.

``pre_instrument`` runs before any instrumentor asks for a tracer, so it is where the provider
gets the rollout-identity span processor and its safe defaults (``safe_defaults``).
It also makes the instrumentors of the LLM SDKs and frameworks spanrl depends on wait until the
agent imports their library (``deferred_instrumentors``; ``post_instrument`` gives the loader
back). ``post_instrument`` turns on openinference's OpenAI instrumentor if spanrl's is on and
openinference's own entry point did not (spanrl's needs its LLM span), and makes sure of the
above in case another hook replaced the provider. When telemetry is off (the SDK disabled,
spanrl's instrumentor skipped) they say so once on stderr (``telemetry_status``). Neither ever
raises: a failure is logged and the agent starts anyway.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import TracerProvider

from spanrl.exporter import deferred_instrumentors, safe_defaults, telemetry_status
from spanrl.exporter import environment_variables as env
from spanrl.exporter.span_processor import install_identity_processor
from spanrl.instrumentation import openai_instrumentor
from spanrl.instrumentation.settings import InstrumentationSettings

logger = logging.getLogger(__name__)

_applied_to: set[int] = set()


def _sdk_provider() -> TracerProvider | None:
    provider = trace_api.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        return provider
    logger.warning(
        "spanrl: the global tracer provider is %s, not the OTel SDK's; rollout identity will "
        "not be stamped (is OTEL_TRACES_EXPORTER set and the SDK configurator enabled?)",
        type(provider).__name__,
    )
    return None


def _prepare_provider(tracer_provider: TracerProvider | None = None) -> list[str]:
    """Install the identity processor and safe defaults once per provider (default: the global
    one); what was done."""
    provider = tracer_provider if tracer_provider is not None else _sdk_provider()
    if provider is None or id(provider) in _applied_to:
        return []
    _applied_to.add(id(provider))
    done = []
    if install_identity_processor(provider):
        done.append("rollout identity processor added")
    settings = InstrumentationSettings.from_env()
    if not settings.safe_defaults:
        return done
    if safe_defaults.raise_attribute_count_limit(provider):
        done.append(f"span attribute count limit {safe_defaults.RAISED_ATTRIBUTE_COUNT_LIMIT}")
    if safe_defaults.sample_everything(provider):
        done.append("sampler always_on")
    signals = safe_defaults.unrequested_signal_exporters(safe_defaults.initial_environment())
    for signal in safe_defaults.turn_off_signal_exporters(signals):
        done.append(f"{signal} exporter off")
    if os.environ.get(env.OTEL_SPANRL_RECEIVER_TOKEN) and "authorization" not in os.environ.get(
        "OTEL_EXPORTER_OTLP_HEADERS", ""
    ).lower():
        logger.warning(
            "spanrl: %s is set but opentelemetry-instrument sends no authorization header; set "
            "OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%%20<token>",
            env.OTEL_SPANRL_RECEIVER_TOKEN,
        )
    return done


def pre_instrument(tracer_provider: TracerProvider | None = None) -> None:
    """Called by opentelemetry-instrument after the SDK is configured, before instrumentors.
    ``tracer_provider``: prepare this provider instead of the global one."""
    try:
        telemetry_status.say_if_sdk_disabled()
        # a disabled SDK has no provider to prepare (said once on stderr just above)
        done = [] if telemetry_status.sdk_disabled() else _prepare_provider(tracer_provider)
        if done:
            logger.info("spanrl: %s", "; ".join(done))
        openai_instrumentor.auto_instrumentation_started()
        if InstrumentationSettings.from_env().defer_instrumentors:
            deferred_instrumentors.defer_until_imported()
    except Exception:  # noqa: BLE001 - never stop the agent from starting
        logger.exception("spanrl: pre-instrument hook failed")


def post_instrument(tracer_provider: TracerProvider | None = None) -> None:
    """Called by opentelemetry-instrument after all instrumentors; idempotent with the above."""
    try:
        deferred_instrumentors.stop_deferring()
        openai_instrumentor.ensure_openinference_after_auto()
        telemetry_status.say_if_instrumentor_skipped(
            openai_instrumentor.SpanrlOpenAIInstrumentor().is_instrumented_by_opentelemetry)
        done = [] if telemetry_status.sdk_disabled() else _prepare_provider(tracer_provider)
        if done:
            logger.info("spanrl (post-instrument): %s", "; ".join(done))
    except Exception:  # noqa: BLE001
        logger.exception("spanrl: post-instrument hook failed")
