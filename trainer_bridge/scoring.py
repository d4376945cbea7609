"""Scoring: an assembled rollout of the store -> a ``ScoredRollout``, or the reason it is left out.

A rollout's score is its total reward (``reward: events``; only the receiver's AIR rule rewards
with ``trust_agent_rewards: false``) or the configured reward function's value on its task and
variables (and calls, when it asks for them: ``rollout_calls.py``), plus the rollout's intermediate
rewards when it is trained on: its AIR rule rewards and the per-call rewards the function gave (a
held-out rollout of a validation round or ``spanrl eval`` is scored by the function's outcome
alone). With a reward function and ``air_per_call`` (``advantage_level: transition``), each trained
call's return is the outcome plus the intermediate rewards of that call alone, so a rule's penalty
(or the function's reward for one call) reaches the call that earned it and not its rollout's
other calls. With ``reward:
judge`` the score made here is only the base the judge combines with (``judge.combine_with``'s
value, or 0 without one): ``judge/group_judge.py`` then scores each group in one request and sets
every member's score (or leaves the group out, ``LEFT_OUT_JUDGE_FAILED``).
Only the calls of the selected agents (``agents``) are kept for training. A rollout that failed,
has no usable transition, no reward, or whose reward function raised is left out with a reason
the step's metrics count (``LEFT_OUT_*``). Called by ``training_loop.TrainingLoop.collect``;
``load_reward_function`` also by the warm start.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from spanrl.bridge_protocol import Attempt
from spanrl.schema.rollouts import AssembledRollout, Transition
from spanrl.schema.scored import ScoredRollout

from .rollout_calls import FunctionReward, call_reward

if TYPE_CHECKING:
    from spanrl.otlp_receiver.store import SpanStore

logger = logging.getLogger(__name__)

AIR_SOURCE_PREFIX = "air:"  # Reward.source of a reward made by one of the receiver's AIR rules
# why a rollout of the store is left out (the keys of a step's rollouts_left_out)
LEFT_OUT_FAILED = "failed"
LEFT_OUT_NO_TRANSITIONS = "no_transitions"
LEFT_OUT_NO_SELECTED_AGENT = "no_selected_agent"
LEFT_OUT_REWARD_ERROR = "reward_error"
LEFT_OUT_NO_REWARD = "no_reward"
LEFT_OUT_UNASSEMBLED = "unassembled"  # reported ok, but its spans never made a rollout within assembly_wait_s
LEFT_OUT_JUDGE_FAILED = "judge_failed"  # reward judge: the judge's request for its group failed (reason logged)
EVENTS_REWARD = "events"
JUDGE_REWARD = "judge"  # reward: judge (the judge: block)


class RewardFunctionError(Exception):
    """The configured reward function raised on a rollout (which is then left out)."""


def load_reward_function(spec: str, python_path: list) -> Callable[..., Any]:
    """The ``module:function`` reward, importable from ``python_path`` folders; it is called
    as ``reward(task, variables)``, or ``reward(task, variables, calls)`` when it has a parameter
    named ``calls`` (``rollout_calls.py``), and returns a number."""
    from spanrl.import_path import load_callable

    return load_callable(spec, python_path)


def rule_reward(rollout: AssembledRollout) -> float | None:
    """The sum of a rollout's AIR rule rewards (None when it has none): what counts when the
    agent's own reward events are not trusted."""
    values = [r.value for r in rollout.rewards if r.source.startswith(AIR_SOURCE_PREFIX)]
    return sum(values) if values else None


def with_air(outcome: float, air: float | None) -> float:
    """A rollout's score: its outcome plus the intermediate rewards added to it (``intermediate_added``;
    None: none)."""
    return outcome if air is None else outcome + air


def with_call_returns(transitions: tuple[Transition, ...], rollout: AssembledRollout, outcome: float,
                      call_rewards: dict[str, float]) -> tuple[Transition, ...]:
    """``transitions``, each with return ``outcome`` plus its own call's intermediate rewards: the AIR
    rule rewards of that call and the reward function's reward for it (``call_rewards``, by span id)."""
    by_call = dict(call_rewards)
    for r in rollout.rewards:
        if r.source.startswith(AIR_SOURCE_PREFIX) and r.call_span_id is not None:
            by_call[r.call_span_id] = by_call.get(r.call_span_id, 0.0) + r.value
    return tuple(replace(t, return_=outcome + by_call.get(t.span_id, 0.0)) for t in transitions)


class RolloutScorer:
    """Scores rollouts as ``reward``, ``trust_agent_rewards`` and ``agents`` say (module docstring)."""

    def __init__(self, reward: str, python_path: list, trust_agent_rewards: bool = True,
                 agents: list | None = None, judge: Any = None, air_per_call: bool = False,
                 store: SpanStore | None = None) -> None:
        self.reward = reward
        self.store = store  # where a reward function that asks for the rollout's calls reads them
        self.judged = reward == JUDGE_REWARD
        # the function scoring each rollout: the reward function, or the judge's combine_with (if any)
        function = (judge.combine_with if judge is not None else "") if self.judged else reward
        self.function_spec = "" if function == EVENTS_REWARD else function
        self.reward_fn = load_reward_function(self.function_spec, python_path) if self.function_spec else None
        self.trust_agent_rewards = trust_agent_rewards
        self.agents = list(agents or [])
        # a reward function's rollouts: each trained call's return is the outcome + its own intermediate rewards
        self.air_per_call = air_per_call and self.reward_fn is not None and not self.judged
        # False (spanrl eval): a rollout is scored as an outcome even without a transition to train on
        self.require_transitions = True

    def scored(self, attempt: Attempt, rollout: AssembledRollout, held_out: bool = False) -> ScoredRollout | str:
        """``rollout`` (of ``attempt``) scored, or why it is left out (a ``LEFT_OUT_*`` reason)."""
        if rollout.status != "ok":
            return LEFT_OUT_FAILED
        if not rollout.transitions and self.require_transitions:
            return LEFT_OUT_NO_TRANSITIONS
        # selective optimisation: only the named agents' calls are trained on
        transitions = tuple(t for t in rollout.transitions if not self.agents or t.agent_name in self.agents)
        if not transitions and self.require_transitions:
            return LEFT_OUT_NO_SELECTED_AGENT
        try:
            base = self.base_reward(attempt, rollout)
        except RewardFunctionError:
            return LEFT_OUT_REWARD_ERROR
        if base is None:
            return LEFT_OUT_NO_REWARD
        if self.air_per_call and not held_out:
            transitions = with_call_returns(transitions, rollout, base.outcome, base.call_rewards)
        score = with_air(base.outcome, self.intermediate_added(rollout, base, held_out))
        per_call = bool(base.call_rewards) and not held_out
        return ScoredRollout(attempt, score, transitions, self.reward_source(rollout, held_out, per_call))

    @property
    def by_events(self) -> bool:
        """Whether rollouts are scored by their reward events (``reward: events``)."""
        return self.reward == EVENTS_REWARD

    def reward_source(self, rollout: AssembledRollout, held_out: bool = False, per_call: bool = False) -> str:
        """What scored the rollout, as ``spanrl inspect`` shows it (``per_call``: the function gave
        its calls rewards of their own, counted in the score)."""
        if self.judged:
            return "judge (pending)"  # the judge sets its own source with its score
        if self.reward_fn is not None:
            air = "" if held_out or rule_reward(rollout) is None else " + AIR rules"
            calls = " + per-call rewards" if per_call else ""
            return f"reward function {self.reward}{calls}{air}"
        return "events: " + ", ".join(sorted({r.source for r in rollout.rewards}))

    def score(self, attempt: Attempt, rollout: AssembledRollout, held_out: bool = False) -> float | None:
        """The rollout's score: its outcome plus, with a reward function, its intermediate rewards
        (AIR rules, the function's per-call rewards) unless ``held_out`` (the intermediate rewards
        train the calls that earned them; a held-out score is the task's outcome); ``None`` when
        there is no outcome. Raises ``RewardFunctionError`` as ``base_reward`` does."""
        base = self.base_reward(attempt, rollout)
        return None if base is None else with_air(base.outcome, self.intermediate_added(rollout, base, held_out))

    def intermediate_added(self, rollout: AssembledRollout, base: FunctionReward, held_out: bool) -> float | None:
        """The AIR rule rewards and per-call rewards added to a reward function's outcome (None:
        nothing added; with ``reward: events`` they are already in the total)."""
        if self.reward_fn is None or held_out or self.judged:
            return None
        rules = rule_reward(rollout)
        if not base.call_rewards:
            return rules
        return (rules or 0.0) + sum(base.call_rewards.values())

    def base_reward(self, attempt: Attempt, rollout: AssembledRollout) -> FunctionReward | None:
        """The rollout's total reward (``reward: events``) or the reward function's outcome and per-call
        rewards; ``None`` when there is none (no reward event, a non-finite value). Raises
        ``RewardFunctionError`` (logged, with the task id) when the reward function raised or gave a
        value that is not a reward."""
        if self.judged and self.reward_fn is None:
            return FunctionReward(0.0)  # no combine_with: the judge's score alone (group_judge sets it)
        if self.reward_fn is None:
            total = rollout.total_reward if self.trust_agent_rewards else rule_reward(rollout)
            return FunctionReward(total) if total is not None and math.isfinite(total) else None
        try:
            value = call_reward(self.reward_fn, attempt.task, rollout, self.store)
        except Exception as exc:  # a broken reward function must not kill training: skip the rollout
            logger.exception("reward function %s failed on task %s (rollout %s): rollout left out",
                             self.function_spec, attempt.task_id, rollout.rollout_id)
            raise RewardFunctionError(f"reward function failed on task {attempt.task_id}") from exc
        if not math.isfinite(value.outcome):
            logger.warning("reward function %s gave %r for task %s (rollout %s): left out", self.function_spec,
                           value.outcome, attempt.task_id, rollout.rollout_id)
            return None
        return value
