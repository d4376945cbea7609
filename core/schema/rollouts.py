"""The transition schema: frozen dataclasses for rewards, transitions and assembled rollouts.

The receiver's assembly (``otlp_receiver/assembly.py``) builds them from a rollout's span tree;
its store (``otlp_receiver/store.py``) saves them as JSON (``rollout_to_dict`` /
``rollout_from_dict``) and hands them to the trainer bridge through
``SpanStore.completed_rollouts``; the training loop scores them and ``spanrl inspect`` prints
them. The field list is the dataclasses' own (docs/interfaces.md section 2); the JSON keys are
the field names, except ``return_`` (``return`` is a Python keyword), written ``return``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
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
# What assembly counted in ``AssembledRollout.counters`` (only counts above zero are kept): reward
# events clipped to or rejected for the receiver's reward range (or a non-finite, non-numeric
# value), reward events that repeated an earlier one, gen_ai.evaluation.result events not counted
# as rewards (not opted in), calls whose agent-side token ids differ from the endpoint's record.
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
class AssembledRollout:
    """One execution of the agent on a task as the receiver assembled it: its transitions in
    call order, rewards, variables (the agent side's ``with rollout(...)`` handle is another
    thing: ``spanrl.instrumentation.Rollout``)."""

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


# JSON key of a field where it differs from the field's name
_JSON_KEYS = {"return_": "return"}
_OLD_JSON_KEYS = {"return_": "return_"}  # stores written by spanrl 0.1


def _plain(value: Any) -> Any:
    """``value`` JSON-ready: tuples become lists, dataclasses dicts, at any depth."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        return _to_dict(value)
    return value


def _to_dict(record: Any) -> dict[str, Any]:
    return {_JSON_KEYS.get(f.name, f.name): _plain(getattr(record, f.name)) for f in fields(record)}


def rollout_to_dict(rollout: AssembledRollout) -> dict[str, Any]:
    """A JSON-ready dict of ``rollout`` (tuples become lists)."""
    return _to_dict(rollout)


def reward_to_dict(reward: Reward) -> dict[str, Any]:
    return _to_dict(reward)


def transition_to_dict(transition: Transition) -> dict[str, Any]:
    """JSON keys are plain words: the field ``return_`` is ``return``."""
    return _to_dict(transition)


def _tuples(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def transition_from_dict(data: dict[str, Any]) -> Transition:
    """The inverse of ``transition_to_dict`` (also reads the ``return_`` key of 0.1 stores)."""
    values = {}
    for f in fields(Transition):
        key = _JSON_KEYS.get(f.name, f.name)
        values[f.name] = _tuples(data[key] if key in data else data[_OLD_JSON_KEYS.get(f.name, key)])
    return Transition(**values)


def rollout_from_dict(data: dict[str, Any]) -> AssembledRollout:
    """The inverse of ``rollout_to_dict`` (keys with a default may be absent: older stores)."""
    values: dict[str, Any] = {}
    for f in fields(AssembledRollout):
        if f.name in data:
            values[f.name] = data[f.name]
    values["rewards"] = tuple(Reward(**r) for r in data["rewards"])
    values["variables"] = dict(data["variables"])
    values["transitions"] = tuple(transition_from_dict(t) for t in data["transitions"])
    values["problems"] = tuple(data["problems"])
    values["counters"] = dict(data.get("counters", {}))
    return AssembledRollout(**values)
