"""Safe tracing defaults for RL, applied to an SDK ``TracerProvider`` that already exists.

Called by the ``opentelemetry-instrument`` pre-instrument hook (the distro has built the
provider before any hook runs) and by ``start_tracing``. Every default yields to a user choice:

- span attribute count limit raised to ``RAISED_ATTRIBUTE_COUNT_LIMIT`` unless
  ``OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT`` or ``OTEL_ATTRIBUTE_COUNT_LIMIT`` is set (the SDK default
  of 128 silently drops attributes of long chats, identity included);
- every span sampled (``always_on``) unless ``OTEL_TRACES_SAMPLER`` is set;
- metrics and logs exporters off unless ``OTEL_METRICS_EXPORTER`` / ``OTEL_LOGS_EXPORTER`` was
  set when the process started (the distro sets both to ``otlp`` during start-up, so only
  the process's *initial* environment tells who chose them; see ``initial_environment``).

The SDK reads limits and sampler when a provider creates a tracer, so both are replaced on the
provider and on the tracers it already created. These are private SDK fields (checked by the
tests on the installed SDK); if they change, spanrl logs a warning and keeps the SDK's values.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

logger = logging.getLogger(__name__)

RAISED_ATTRIBUTE_COUNT_LIMIT = 65536
_ATTRIBUTE_LIMIT_VARIABLES = ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "OTEL_ATTRIBUTE_COUNT_LIMIT")
_SAMPLER_VARIABLE = "OTEL_TRACES_SAMPLER"
_METRICS_EXPORTER_VARIABLE = "OTEL_METRICS_EXPORTER"
_LOGS_EXPORTER_VARIABLE = "OTEL_LOGS_EXPORTER"


def initial_environment() -> Mapping[str, str] | None:
    """The environment the process was started with, or None where it cannot be known.

    ``os.environ`` (and ``posix.environ``, its backing dict) change as code runs: the distro
    ``setdefault``s the exporters. On Linux, ``/proc/self/environ`` still holds the block the
    process was started with; elsewhere this returns None."""
    try:
        with open("/proc/self/environ", "rb") as file:
            block = file.read()
    except OSError:
        return None
    result = {}
    for entry in block.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep:
            result[key.decode(errors="replace")] = value.decode(errors="replace")
    return result


def raise_attribute_count_limit(provider: TracerProvider, environ: Mapping[str, str] = os.environ) -> bool:
    """Raise the provider's span attribute count limit unless the user set one; True if done."""
    if any(environ.get(name, "").strip() for name in _ATTRIBUTE_LIMIT_VARIABLES):
        return False
    try:
        old: SpanLimits = provider._span_limits  # noqa: SLF001
        limits = SpanLimits(
            max_attributes=old.max_attributes,
            max_events=old.max_events,
            max_links=old.max_links,
            max_span_attributes=RAISED_ATTRIBUTE_COUNT_LIMIT,
            max_event_attributes=old.max_event_attributes,
            max_link_attributes=old.max_link_attributes,
            max_attribute_length=old.max_attribute_length,
            max_span_attribute_length=old.max_span_attribute_length,
        )
        provider._span_limits = limits  # noqa: SLF001
        for tracer in _existing_tracers(provider):
            tracer._span_limits = limits  # noqa: SLF001
        return True
    except AttributeError as exc:
        logger.warning("spanrl: could not raise the span attribute count limit (%s); set "
                       "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT yourself", exc)
        return False


def sample_everything(provider: TracerProvider, environ: Mapping[str, str] = os.environ) -> bool:
    """Make the provider sample every span unless the user chose a sampler; True if done."""
    if environ.get(_SAMPLER_VARIABLE, "").strip():
        return False
    try:
        provider.sampler = ALWAYS_ON
        for tracer in _existing_tracers(provider):
            tracer.sampler = ALWAYS_ON
        return True
    except AttributeError as exc:
        logger.warning("spanrl: could not set the always_on sampler (%s)", exc)
        return False


def _existing_tracers(provider: TracerProvider) -> list:
    lock = getattr(provider, "_tracers_lock", None)
    tracers = getattr(provider, "_tracers", {})
    if lock is None:
        return list(tracers.values())
    with lock:
        return list(tracers.values())


def unrequested_signal_exporters(initial: Mapping[str, str] | None) -> list[str]:
    """Which of ``metrics`` / ``logs`` run an exporter nobody asked for.

    With ``initial`` None (start-up environment unknown) nothing is judged unrequested."""
    if initial is None:
        return []
    signals = []
    for signal, variable in (("metrics", _METRICS_EXPORTER_VARIABLE), ("logs", _LOGS_EXPORTER_VARIABLE)):
        if variable not in initial and os.environ.get(variable, "none").strip() not in ("", "none"):
            signals.append(signal)
    return signals


def turn_off_signal_exporters(signals: list[str]) -> list[str]:
    """Shut down the global meter / logger providers' exporters for ``signals``; what was done.

    The SDK configurator already built them, so their readers and processors are shut down
    (no export thread, no connection attempts); meters and instruments keep working, unexported. The
    environment variable is set to ``none`` too, so child processes do not start them."""
    done = []
    for signal in signals:
        try:
            if signal == "metrics":
                from opentelemetry.metrics import get_meter_provider  # noqa: PLC0415

                meter_provider: Any = get_meter_provider()  # the SDK's, or AttributeError: left on
                for reader in meter_provider._metric_readers:  # noqa: SLF001
                    reader.shutdown()
                # The provider stays usable (meters keep working, unexported); only its
                # at-exit shutdown goes, as it would shut the readers down a second time.
                atexit.unregister(meter_provider.shutdown)
                os.environ[_METRICS_EXPORTER_VARIABLE] = "none"
            elif signal == "logs":
                from opentelemetry._logs import get_logger_provider  # noqa: PLC0415

                logger_provider = get_logger_provider()
                processor = getattr(logger_provider, "_multi_log_record_processor", None)
                if processor is not None:
                    processor.shutdown()
                os.environ[_LOGS_EXPORTER_VARIABLE] = "none"
            done.append(signal)
        except Exception as exc:  # noqa: BLE001 - leave the exporter on rather than fail
            logger.warning("spanrl: could not turn off the %s exporter: %s", signal, exc)
    return done
