"""A rollout's LLM calls as text, for reward functions that judge the way as well as the answer.

A reward function ``reward(task, variables)`` sees the task and what the agent returned. One
that takes a parameter named ``calls`` (``reward(task, variables, calls)``) is also given the
rollout's LLM calls, read back from the spans in the store, in call order: each a dict
``{"span_id": ..., "agent": ..., "messages": [...], "reply": {...}}``:

- ``messages``: the prompt the model saw, in chat-completions form (``role``, ``content``, an
  assistant's ``tool_calls``; ``tool`` messages hold the tool results the agent was shown);
- ``reply``: the model's answer (an assistant message, possibly of tool calls), or None;
- ``agent``: the agent name of the call's transition (None for a call without one);
- ``span_id``: the call's span (hex), as ``Transition.span_id``.

So a reward can measure progress the answer alone does not show, from the trace alone: which
documents a search reached, which tests a patch passed. It returns a number (the rollout's
outcome), or ``{"outcome": number, "calls": [number per call]}``: each call's entry is an
intermediate reward of that call, as an AIR rule's is (added to the rollout's score; with
``advantage_level: transition`` to that call's return alone; never to a held-out score). The text
is what the agent's instrumentation recorded (OpenInference message attributes, on by default with
spanrl's instrumentation); a call recorded without text has empty ``messages``. Used by
``scoring.py`` and the warm start's choice of rollouts. Torch-free.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
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
        calls.append({"span_id": record.key, "agent": agents.get(record.key), "messages": chat.messages,
                      "reply": chat.reply})
    return calls


@dataclass(frozen=True)
class FunctionReward:
    """What a reward function gave a rollout: its outcome and the intermediate rewards of its calls."""

    outcome: float
    call_rewards: dict[str, float] = field(default_factory=dict)  # call span id -> reward


def call_reward(function: Callable[..., Any], task: Any, rollout: AssembledRollout,
                store: SpanStore | None) -> FunctionReward:
    """``function``'s value on ``rollout`` of ``task`` (given its calls when it asks for them).
    Raises ``ValueError`` naming what is wrong with a value that is neither a number nor
    ``{"outcome": ..., "calls": [...]}`` with one entry per call."""
    variables = dict(rollout.variables)
    if not takes_calls(function):
        return _function_reward(function(task, variables), None)
    if store is None:
        raise ValueError("the reward function asks for the rollout's calls, and no store was given to read them from")
    calls = rollout_calls(store, rollout)
    return _function_reward(function(task, variables, **{CALLS_PARAMETER: calls}), calls)


def _function_reward(value: Any, calls: list[dict[str, Any]] | None) -> FunctionReward:
    if not isinstance(value, Mapping):
        return FunctionReward(float(value))
    if "outcome" not in value or set(value) - {"outcome", "calls"}:
        raise ValueError("a reward function's mapping needs the key 'outcome' and may have 'calls', "
                         f"got {sorted(value)}")
    outcome = float(value["outcome"])
    per_call = [float(reward) for reward in value.get("calls") or []]
    if not per_call:
        return FunctionReward(outcome)
    if calls is None:
        raise ValueError("the reward function gave per-call rewards without taking a 'calls' parameter")
    if len(per_call) != len(calls):
        raise ValueError(f"the reward function gave {len(per_call)} per-call rewards for {len(calls)} calls")
    call_rewards = {}  # a call's span id is unique among a rollout's kept calls
    for call, reward in zip(calls, per_call, strict=True):
        if not math.isfinite(reward):
            raise ValueError(f"the reward function gave the call {call['span_id']} a non-finite reward {reward!r}")
        if reward:
            call_rewards[call["span_id"]] = reward
    return FunctionReward(outcome, call_rewards)


__all__ = ["CALLS_PARAMETER", "FunctionReward", "call_reward", "rollout_calls", "takes_calls"]
