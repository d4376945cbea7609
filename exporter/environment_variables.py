"""Every ``OTEL_SPANRL_*`` environment variable of the agent side, one constant each.

Registered as the ``opentelemetry_environment_variables`` entry point, so each constant also
becomes an ``opentelemetry-instrument`` flag: ``OTEL_SPANRL_REQUEST_TOKEN_IDS`` can be given as
``opentelemetry-instrument --spanrl_request_token_ids false python agent.py``.
Only constants that start with ``OTEL_`` belong here (the CLI turns each into a flag). Loading
this module in the launcher also checks that the OTel SDK will start in the agent
(``telemetry_status.check_in_launcher``: one line on stderr when it will not).
"""

from spanrl.exporter import telemetry_status as _telemetry_status
from spanrl.instrumentation.settings import (  # the instrumentation's own, read there
    OTEL_SPANRL_DEFER_INSTRUMENTORS,
    OTEL_SPANRL_REQUEST_TOKEN_IDS,
    OTEL_SPANRL_SAFE_DEFAULTS,
)

__all__ = ["OTEL_SPANRL_DEFER_INSTRUMENTORS", "OTEL_SPANRL_RECEIVER_TOKEN", "OTEL_SPANRL_REQUEST_TOKEN_IDS",
           "OTEL_SPANRL_SAFE_DEFAULTS"]

OTEL_SPANRL_RECEIVER_TOKEN = "OTEL_SPANRL_RECEIVER_TOKEN"
"""Bearer token sent to the spanrl receiver as ``authorization: Bearer <token>`` by
``spanrl.exporter.in_process.start_tracing`` (under ``opentelemetry-instrument`` use
``OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20<token>``)."""

_telemetry_status.check_in_launcher()  # only in the opentelemetry-instrument launcher; never raises
