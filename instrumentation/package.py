"""The libraries spanrl's auto-instrumentors patch, read by ``opentelemetry-instrument``.

``opentelemetry-instrument`` reads the ``instruments-any`` extra of the spanrl distribution
(pyproject.toml: spanrl's instrumentors load when any of the SDKs is installed) and each
``BaseInstrumentor.instrument()`` reads its own requirement (``_instruments`` for OpenAI's SDK,
``_instruments_anthropic`` for Anthropic's); the extra lists exactly those (a test checks it).
When an instrumentor's library is missing (or too old), that instrumentor is skipped with a log
line instead of failing the agent's start-up.

openai >= 1.60: the oldest SDK whose ``BaseClient._build_request``,
``AsyncAPIClient._process_response`` and ``BaseClient._process_response_data`` have the shape
``sdk_calls`` wraps, and whose responses keep the ``httpx.Request`` it built (read in the
sources of 1.60 and 1.69; the tests run against the installed SDK, which openinference's OpenAI
instrumentor takes from 2.8 on). openinference's OpenAI instrumentor, which makes the LLM span,
has its own range; ``openai_instrumentor`` warns when that one declines the installed SDK.
"""

_instruments = ("openai >= 1.60",)
# anthropic >= 1.8 (what openinference's Anthropic instrumentor takes): its ``_base_client`` has the same
# three methods (checked against 2.10).
_instruments_anthropic = ("anthropic >= 1.8",)
_instruments_any = _instruments + _instruments_anthropic
