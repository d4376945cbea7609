"""Agent-side instrumentation: what runs inside the agent process.

Auto-instrumentors (registered as ``opentelemetry_instrumentor`` entry points) record token ids
on LLM spans; the helpers below let an agent, or the runner, mark rollouts, rewards, semantic
variables and agent names. Never imports torch.
"""

from spanrl.instrumentation.rollout import (
    Rollout,
    RolloutIdentity,
    agent,
    bind_context,
    current_agent_name,
    current_identity,
    emit_reward,
    rollout,
    set_variable,
)

__all__ = [
    "Rollout",
    "RolloutIdentity",
    "agent",
    "bind_context",
    "current_agent_name",
    "current_identity",
    "emit_reward",
    "rollout",
    "set_variable",
]
