"""spanrl: train the LLM inside an existing agent with RL, from its OpenTelemetry traces alone.

Components live in subpackages: ``spanrl.instrumentation`` and ``spanrl.exporter`` (agent side),
``spanrl.otlp_receiver``, ``spanrl.trainer_bridge`` and ``spanrl.runner`` (sidecars).
"""

__version__ = "0.1.0"
