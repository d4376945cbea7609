"""Which reward events of a rollout count, and with what value: the receiver's reward trust rules.

Called by ``assembly.assemble_rollout`` once per rollout. Reward events come from the agent's
process, which the receiver cannot vouch for (docs/trust.md), so they pass four checks, each
counted in the rollout's ``counters`` (``spanrl.schema.rollouts.COUNTER_*``) and said in its ``problems``:

- ``spanrl.reward`` events count; ``gen_ai.evaluation.result`` events count only when the user
  opted in (``RewardPolicy.evaluation_events``, ``--evaluation-rewards``): evaluation libraries
  emit them for monitoring, and a score meant for a dashboard must not become a reward unasked;
- a value must be a finite number: anything else is rejected;
- a value outside ``[minimum, maximum]`` is clipped to the range or rejected (``out_of_range``);
- the same event replayed (same event name, reward name, value, timestamp and response id, on any
  span of the rollout) counts once: a span re-sent under a new span id, or an event recorded
  twice, does not add its reward again.

The call a reward judges is ``assembly``'s rule (``_Calls.call_for_span``, or the call whose
``gen_ai.response.id`` the event names).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.settings import OUT_OF_RANGE_MODES, REWARD_MAX_DEFAULT, REWARD_MIN_DEFAULT
from spanrl.otlp_receiver.span_tree import SpanRecord, SpanTree
from spanrl.schema.rollouts import (
    COUNTER_EVALUATIONS_IGNORED,
    COUNTER_REWARDS_CLIPPED,
    COUNTER_REWARDS_REJECTED,
    COUNTER_REWARDS_REPLAYED,
    Reward,
)

EXAMPLES_PER_PROBLEM = 3  # a rollout of many bad events lists a few, then a count


@dataclass(frozen=True)
class RewardPolicy:
    """What the receiver accepts as a reward (the ``reward_*`` and ``evaluation_rewards`` settings)."""

    minimum: float = REWARD_MIN_DEFAULT
    maximum: float = REWARD_MAX_DEFAULT
    out_of_range: str = "reject"  # or "clip"
    evaluation_events: bool = False

    def __post_init__(self) -> None:
        if self.out_of_range not in OUT_OF_RANGE_MODES:
            raise ValueError(f"out_of_range must be one of {OUT_OF_RANGE_MODES}, got {self.out_of_range!r}")
        if not (math.isfinite(self.minimum) and math.isfinite(self.maximum) and self.minimum < self.maximum):
            raise ValueError(f"the reward range must be finite with minimum < maximum, got "
                             f"[{self.minimum}, {self.maximum}]")


class CallFinder(Protocol):
    """What ``event_rewards`` needs of assembly's calls (``assembly._Calls``)."""

    by_response_id: dict[str, SpanRecord]

    def call_for_span(self, record: SpanRecord) -> SpanRecord | None: ...


class _Findings:
    """A rollout's counters, and its problems of one kind listed a few at a time."""

    def __init__(self, counters: Counter) -> None:
        self.counters = counters
        self.examples: dict[str, list[str]] = {}

    def count(self, counter: str, example: str | None = None) -> None:
        self.counters[counter] += 1
        if example is not None:
            self.examples.setdefault(counter, []).append(example)

    def say(self, problems: list[str]) -> None:
        for counter, examples in self.examples.items():
            problems.extend(examples[:EXAMPLES_PER_PROBLEM])
            if len(examples) > EXAMPLES_PER_PROBLEM:
                problems.append(f"... and {len(examples) - EXAMPLES_PER_PROBLEM} more ({counter})")
        replayed = self.counters[COUNTER_REWARDS_REPLAYED]
        if replayed:
            problems.append(f"{replayed} reward event(s) repeated an earlier one (same name, value, time and"
                            " response id) and counted once")
        ignored = self.counters[COUNTER_EVALUATIONS_IGNORED]
        if ignored:
            problems.append(f"{ignored} {semconv.GENAI_EVALUATION_EVENT} event(s) not counted as rewards"
                            " (evaluation_rewards is off)")


def event_rewards(tree: SpanTree, calls: CallFinder, policy: RewardPolicy, problems: list[str],
                  counters: Counter) -> list[Reward]:
    """The rewards of every reward event in ``tree`` that passes ``policy``, in tree order."""
    findings = _Findings(counters)
    seen: set[tuple[Any, ...]] = set()
    rewards: list[Reward] = []
    for record in tree.order:
        for event in record.events:
            if event.name == semconv.REWARD_EVENT:
                raw = event.attributes.get(semconv.REWARD_VALUE)
                name = event.attributes.get(semconv.REWARD_NAME) or semconv.DEFAULT_REWARD_NAME
            elif event.name == semconv.GENAI_EVALUATION_EVENT:
                if not policy.evaluation_events:
                    findings.count(COUNTER_EVALUATIONS_IGNORED)
                    continue
                raw = event.attributes.get(semconv.GENAI_EVALUATION_SCORE)
                name = event.attributes.get(semconv.GENAI_EVALUATION_NAME) or "evaluation"
            else:
                continue
            response_id = event.attributes.get(semconv.REWARD_RESPONSE_ID) or event.attributes.get(
                semconv.GENAI_RESPONSE_ID)
            identity = (event.name, str(name), raw, event.time_ns, response_id)
            if identity in seen:
                findings.count(COUNTER_REWARDS_REPLAYED)
                continue
            seen.add(identity)
            value = _checked_value(raw, f"{event.name} {name!r} on span {record.key}", policy, findings)
            if value is None:
                continue
            call = _judged_call(record, response_id, name, calls, problems)
            rewards.append(Reward(name=str(name), value=value, source=event.name, span_id=record.key,
                                  call_span_id=None if call is None else call.key))
    findings.say(problems)
    return rewards


def _checked_value(raw: Any, what: str, policy: RewardPolicy, findings: _Findings) -> float | None:
    """``raw`` as the reward value the policy allows; None (counted, said) when it is rejected."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        findings.count(COUNTER_REWARDS_REJECTED, f"{what} has no numeric value ({raw!r}); rejected")
        return None
    value = float(raw)
    if not math.isfinite(value):
        findings.count(COUNTER_REWARDS_REJECTED, f"{what} is not finite ({value!r}); rejected")
        return None
    if policy.minimum <= value <= policy.maximum:
        return value
    bounds = f"[{policy.minimum:g}, {policy.maximum:g}]"
    if policy.out_of_range == "clip":
        clipped = min(max(value, policy.minimum), policy.maximum)
        findings.count(COUNTER_REWARDS_CLIPPED, f"{what} = {value:g} is outside {bounds}; clipped to {clipped:g}")
        return clipped
    findings.count(COUNTER_REWARDS_REJECTED, f"{what} = {value:g} is outside {bounds}; rejected")
    return None


def _judged_call(record: SpanRecord, response_id: Any, name: Any, calls: CallFinder,
                 problems: list[str]) -> SpanRecord | None:
    call = None
    if isinstance(response_id, str):
        call = calls.by_response_id.get(response_id)
        if call is None:
            problems.append(f"reward {name!r} names response id {response_id!r}, which no call has;"
                            " attached by parentage instead")
    return call if call is not None else calls.call_for_span(record)
