"""What the receiver produces: frozen dataclasses for rewards, transitions and rollouts.

Assembly (``assembly.py``) builds them from a rollout's span tree; the store (``store.py``)
saves them as JSON and hands them to the trainer bridge through
``SpanStore.completed_rollouts``. The field list is fixed by docs/interfaces.md section 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VariableValue = str | int | float | bool

# How a rollout went: "failed" when its spanrl.rollout span ended with status ERROR, when its
# id was reused by separate runs, or (no spanrl.rollout span) when a top-level span did.
STATUS_OK = "ok"
STATUS_FAILED = "failed"
ROLLOUT_STATUSES = (STATUS_OK, STATUS_FAILED)
# What ended it: its spanrl.rollout span arrived, a runner asked (explicit), or it went idle.
END_ROLLOUT_SPAN = "rollout_span"
END_EXPLICIT = "explicit"
END_IDLE_TIMEOUT = "idle_timeout"
END_REASONS = (END_ROLLOUT_SPAN, END_EXPLICIT, END_IDLE_TIMEOUT)
# What assembly counted in ``Rollout.counters`` (only counts above zero are kept): reward events
# clipped to or rejected for the receiver's reward range (or a non-finite, non-numeric value),
# reward events that repeated an earlier one, gen_ai.evaluation.result events not counted as
# rewards (not opted in), calls whose agent-side token ids differ from the endpoint's record.
COUNTER_REWARDS_CLIPPED = "rewards_clipped"
COUNTER_REWARDS_REJECTED = "rewards_rejected"
COUNTER_REWARDS_REPLAYED = "rewards_replayed"
COUNTER_EVALUATIONS_IGNORED = "evaluations_ignored"
COUNTER_TOKEN_ID_MISMATCHES = "token_id_mismatches"
ROLLOUT_COUNTERS = (COUNTER_REWARDS_CLIPPED, COUNTER_REWARDS_REJECTED, COUNTER_REWARDS_REPLAYED,
                    COUNTER_EVALUATIONS_IGNORED, COUNTER_TOKEN_ID_MISMATCHES)


@dataclass(frozen=True)
class Reward:
    """One reward of a rollout and the LLM call it was attached to.

    ``source`` is the event it came from (``spanrl.reward``, ``gen_ai.evaluation.result``) or
    ``air:<rule name>`` for a reward made by an AIR rule. ``span_id`` is the span that carried
    the event (or matched the rule); ``call_span_id`` the LLM call it judges (None when the
    rollout has no call to attach it to).
    """

    name: str
    value: float
    source: str
    span_id: str
    call_span_id: str | None


@dataclass(frozen=True)
class Transition:
    """One LLM call (one choice of it): state = prompt ids, action = response ids, reward."""

    rollout_id: str
    index: int
    span_id: str
    agent_name: str | None
    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...] | None
    choice_index: int
    policy_version: int | None
    reward: float
    return_: float
    retokenized: bool


@dataclass(frozen=True)
class Rollout:
    """One execution of the agent on a task: its transitions in call order, rewards, variables."""

    rollout_id: str
    task_id: str | None
    attempt: int | None
    status: str
    error: str | None
    end_reason: str
    total_reward: float | None
    rewards: tuple[Reward, ...]
    variables: dict[str, VariableValue]
    transitions: tuple[Transition, ...]
    problems: tuple[str, ...]
    sequence: int
    # Set on an ``ok`` rollout whose status is unverified (no spanrl.rollout span arrived):
    # why, e.g. "...; 2 span(s) ended with status ERROR; no reward". None otherwise.
    status_reason: str | None = None
    # What the receiver's checks counted while assembling it: ROLLOUT_COUNTERS -> count (> 0).
    counters: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in ROLLOUT_STATUSES:
            raise ValueError(f"rollout {self.rollout_id}: status must be one of {ROLLOUT_STATUSES}, "
                             f"got {self.status!r}")
        if self.end_reason not in END_REASONS:
            raise ValueError(f"rollout {self.rollout_id}: end_reason must be one of {END_REASONS}, "
                             f"got {self.end_reason!r}")


def rollout_to_dict(rollout: Rollout) -> dict[str, Any]:
    """A JSON-ready dict of ``rollout`` (tuples become lists)."""
    return {
        "rollout_id": rollout.rollout_id,
        "task_id": rollout.task_id,
        "attempt": rollout.attempt,
        "status": rollout.status,
        "error": rollout.error,
        "status_reason": rollout.status_reason,
        "end_reason": rollout.end_reason,
        "total_reward": rollout.total_reward,
        "rewards": [reward_to_dict(r) for r in rollout.rewards],
        "variables": dict(rollout.variables),
        "transitions": [transition_to_dict(t) for t in rollout.transitions],
        "problems": list(rollout.problems),
        "counters": dict(rollout.counters),
        "sequence": rollout.sequence,
    }


def reward_to_dict(reward: Reward) -> dict[str, Any]:
    return {
        "name": reward.name,
        "value": reward.value,
        "source": reward.source,
        "span_id": reward.span_id,
        "call_span_id": reward.call_span_id,
    }


def transition_to_dict(transition: Transition) -> dict[str, Any]:
    """JSON keys are plain words: the field ``return_`` (``return`` is a Python keyword) is ``return``."""
    return {
        "rollout_id": transition.rollout_id,
        "index": transition.index,
        "span_id": transition.span_id,
        "agent_name": transition.agent_name,
        "prompt_token_ids": list(transition.prompt_token_ids),
        "response_token_ids": list(transition.response_token_ids),
        "response_logprobs": (
            None if transition.response_logprobs is None else list(transition.response_logprobs)
        ),
        "choice_index": transition.choice_index,
        "policy_version": transition.policy_version,
        "reward": transition.reward,
        "return": transition.return_,
        "retokenized": transition.retokenized,
    }


def rollout_from_dict(data: dict[str, Any]) -> Rollout:
    """The inverse of ``rollout_to_dict``."""
    return Rollout(
        rollout_id=data["rollout_id"],
        task_id=data["task_id"],
        attempt=data["attempt"],
        status=data["status"],
        error=data["error"],
        status_reason=data.get("status_reason"),  # absent in stores of older versions
        end_reason=data["end_reason"],
        total_reward=data["total_reward"],
        rewards=tuple(Reward(**r) for r in data["rewards"]),
        variables=dict(data["variables"]),
        transitions=tuple(
            Transition(
                rollout_id=t["rollout_id"],
                index=t["index"],
                span_id=t["span_id"],
                agent_name=t["agent_name"],
                prompt_token_ids=tuple(t["prompt_token_ids"]),
                response_token_ids=tuple(t["response_token_ids"]),
                response_logprobs=(
                    None if t["response_logprobs"] is None else tuple(t["response_logprobs"])
                ),
                choice_index=t["choice_index"],
                policy_version=t["policy_version"],
                reward=t["reward"],
                return_=t["return"] if "return" in t else t["return_"],  # "return_": stores of 0.1
                retokenized=t["retokenized"],
            )
            for t in data["transitions"]
        ),
        problems=tuple(data["problems"]),
        counters=dict(data.get("counters", {})),  # absent in stores of older versions
        sequence=data["sequence"],
    )
