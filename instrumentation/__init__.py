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
    end_rollout_span,
    rollout,
    set_variable,
    start_rollout_span,
)

__all__ = [
    "Rollout",
    "RolloutIdentity",
    "agent",
    "bind_context",
    "current_agent_name",
    "current_identity",
    "emit_reward",
    "end_rollout_span",
    "rollout",
    "set_variable",
    "start_rollout_span",
]
