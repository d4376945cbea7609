"""The verl backend: verl's own workers train, vLLM serves the agents behind a gateway (see docs/verl.md)."""
