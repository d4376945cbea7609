"""The libraries spanrl's auto-instrumentors patch, read by ``opentelemetry-instrument``.

``opentelemetry-instrument`` reads the ``instruments`` extra of the spanrl distribution
(pyproject.toml) and ``BaseInstrumentor.instrument()`` reads ``_instruments``; both must list the
same requirements (a test checks it). When a library listed here is missing (or too old), the
instrumentor is skipped with a log line instead of failing the agent's start-up.

openai >= 1.60: the oldest SDK whose ``SyncAPIClient._process_response``,
``AsyncAPIClient._process_response``, ``BaseClient._build_request`` and
``BaseClient._process_response_data`` have the shape ``openai_instrumentor`` wraps (checked
against 1.60, 1.69, 2.0 and 3.x). openinference's OpenAI instrumentor, which makes the LLM span,
has its own range; ``openai_instrumentor`` warns when that one declines the installed SDK.
"""

_instruments = ("openai >= 1.60",)
