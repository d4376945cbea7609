"""A rollout's LLM calls as text, for reward functions that judge the way as well as the answer.

A reward function ``reward(task, variables)`` sees the task and what the agent returned. One
that takes a parameter named ``calls`` (``reward(task, variables, calls)``) is also given the
rollout's LLM calls, read back from the spans in the store, in call order: each a dict
``{"agent": ..., "messages": [...], "reply": {...}}``:

- ``messages``: the prompt the model saw, in chat-completions form (``role``, ``content``, an
  assistant's ``tool_calls``; ``tool`` messages hold the tool results the agent was shown);
- ``reply``: the model's answer (an assistant message, possibly of tool calls), or None;
- ``agent``: the agent name of the call's transition (None for a call without one).

So a reward can measure progress the answer alone does not show, from the trace alone: which
documents a search reached, which tests a patch passed. The text is what the agent's
instrumentation recorded (OpenInference message attributes, on by default with spanrl's
instrumentation); a call recorded without text has empty ``messages``. Used by ``scoring.py``
and the warm start's choice of rollouts. Torch-free.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from spanrl.otlp_receiver.assembly import kept_calls
from spanrl.otlp_receiver.call_text import from_attributes
from spanrl.otlp_receiver.span_tree import records_from_bodies
from spanrl.schema.rollouts import AssembledRollout

if TYPE_CHECKING:
    from spanrl.otlp_receiver.store import SpanStore

CALLS_PARAMETER = "calls"


def takes_calls(function: Callable[..., Any]) -> bool:
    """Whether a reward function asks for the rollout's calls (a parameter named ``calls``)."""
    try:
        return CALLS_PARAMETER in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature: not asked
        return False


def rollout_calls(store: SpanStore, rollout: AssembledRollout) -> list[dict[str, Any]]:
    """``rollout``'s LLM calls as text, in call order (the module docstring says the shape)."""
    records = records_from_bodies(span.body for span in store.rollout_spans(rollout.rollout_id))
    agents = {t.span_id: t.agent_name for t in rollout.transitions}
    calls = []
    for record in kept_calls(records) if records else []:
        chat = from_attributes(record.attributes)
        calls.append({"agent": agents.get(record.key), "messages": chat.messages, "reply": chat.reply})
    return calls


def call_reward(function: Callable[..., Any], task: Any, rollout: AssembledRollout,
                store: SpanStore | None) -> Any:
    """``function``'s value on ``rollout`` of ``task``: given its calls when it asks for them."""
    variables = dict(rollout.variables)
    if not takes_calls(function):
        return function(task, variables)
    if store is None:
        raise ValueError("the reward function asks for the rollout's calls, and no store was given to read them from")
    return function(task, variables, **{CALLS_PARAMETER: rollout_calls(store, rollout)})


__all__ = ["CALLS_PARAMETER", "call_reward", "rollout_calls", "takes_calls"]
