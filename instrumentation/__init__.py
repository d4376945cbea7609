"""Agent-side instrumentation: what runs inside the agent process.

Auto-instrumentors (registered as ``opentelemetry_instrumentor`` entry points) record token ids
on LLM spans; the helpers below let an agent, or the runner, mark rollouts, rewards, semantic
variables and agent names. Never imports torch.
"""
