"""Settings of spanrl's agent-side instrumentation, read once when instrumenting.

Filled from ``OTEL_SPANRL_*`` environment variables (``opentelemetry-instrument --spanrl_*``
flags set those) and defaults. A bad value is logged and the default used: a typo in a
tracing setting must never stop the agent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from spanrl.env_settings import SettingError, env_value

logger = logging.getLogger(__name__)

# Read here; also listed by spanrl.exporter.environment_variables (the opentelemetry-instrument flags).
OTEL_SPANRL_REQUEST_TOKEN_IDS = "OTEL_SPANRL_REQUEST_TOKEN_IDS"
"""``true`` (default) or ``false``: add vLLM's ``return_token_ids: true`` to chat and
completions requests so the endpoint returns the token ids it saw and sampled."""

OTEL_SPANRL_SAFE_DEFAULTS = "OTEL_SPANRL_SAFE_DEFAULTS"
"""``true`` (default) or ``false``: let spanrl raise the span attribute count limit, sample
every span and turn off the metrics/logs exporters the user did not ask for."""

OTEL_SPANRL_DEFER_INSTRUMENTORS = "OTEL_SPANRL_DEFER_INSTRUMENTORS"
"""``true`` (default) or ``false``: under ``opentelemetry-instrument``, turn on the instrumentors of
the LLM SDKs and agent frameworks spanrl depends on when the agent imports their library, not at
start-up (``spanrl.exporter.deferred_instrumentors``)."""


@dataclass(frozen=True)
class InstrumentationSettings:
    """What the OpenAI instrumentor and the exporter hook do in this process."""

    request_token_ids: bool = True
    safe_defaults: bool = True
    defer_instrumentors: bool = True

    @classmethod
    def from_env(cls) -> InstrumentationSettings:
        defaults = cls()
        return cls(
            request_token_ids=_env_or_default(
                OTEL_SPANRL_REQUEST_TOKEN_IDS, defaults.request_token_ids
            ),
            safe_defaults=_env_or_default(OTEL_SPANRL_SAFE_DEFAULTS, defaults.safe_defaults),
            defer_instrumentors=_env_or_default(OTEL_SPANRL_DEFER_INSTRUMENTORS, defaults.defer_instrumentors),
        )


def _env_or_default(name: str, default: bool) -> bool:
    try:
        return env_value(name, default)
    except SettingError as exc:
        logger.error("spanrl: %s; using the default %r", exc, default)
        return default
