"""The OTLP receiver: durable span store, rollout assembly, span trees -> MDP transitions."""
