"""The libraries spanrl's auto-instrumentors patch, read by ``opentelemetry-instrument``.

When a library listed here is missing (or too old), the instrumentor is skipped with a debug
log instead of failing the agent's start-up.
"""

_instruments = ("openai >= 2.8.0",)
