"""How spans leave the agent process: rollout identity stamping, safe defaults, OTLP export."""
