"""Rollout assembly: one rollout's span tree -> ordered MDP transitions with rewards.

Called by the receiver's assembler thread (``server.py``) when a rollout ends, and by tests
and benchmarks directly::

    rollout = assemble_rollout("r1", records, end_reason="rollout_span", options=AssemblyOptions())

Steps: build the tree (``span_tree``); find the LLM calls (OpenInference kind ``LLM`` or
spanrl token-id attributes); drop duplicates (one call seen by two instrumentors, e.g. a
LangChain LLM span with the OpenAI span under it: an LLM span with LLM spans below it is a
wrapper and is dropped, unless it alone carries token ids, then the spans below it are the
duplicates; a framework LLM span that is not an ancestor of the SDK span of the same call, as
openinference's LangChain tracer makes them, is merged into it when the SDK span lies in its
time window with the same output text; the policy endpoint's own span of a call is merged with
the agent side's by response id, ``endpoint_spans``, whose token ids win); attach rewards (the
events that pass ``rewards.RewardPolicy``) and AIR rewards to calls by structure, never by
timing; one transition per call and choice, in call start order; credit assignment; variables.

Which call a span's reward (or AIR signal) judges, ``call_for_span``:
1. the span is a call -> that call;
2. calls below the span (an ancestor, the rollout root) -> the last of them in tree order;
3. otherwise (a tool span, a sibling after the call) -> the last call before the span in
   depth-first order: the call that led to it;
4. otherwise (nothing before it) -> the first call after it; none when the rollout has no call.
A reward naming ``spanrl.reward.response_id`` goes to the call whose ``gen_ai.response.id``
matches, whatever span carries it.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from openinference.semconv.trace import MessageAttributes, SpanAttributes

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.agent_names import AgentNames
from spanrl.otlp_receiver.air import AirRule
from spanrl.otlp_receiver.credit import credit_function
from spanrl.otlp_receiver.endpoint_spans import same_call_by_response_id, token_id_mismatches
from spanrl.otlp_receiver.retokenize import RetokenizeError, Retokenizer
from spanrl.otlp_receiver.rewards import RewardPolicy, event_rewards
from spanrl.otlp_receiver.rollout_status import rollout_status
from spanrl.otlp_receiver.span_tree import SpanRecord, SpanTree, logprobs_of, token_ids_of
from spanrl.schema.rollouts import (
    COUNTER_TOKEN_ID_MISMATCHES,
    STATUS_FAILED,
    STATUS_OK,
    AssembledRollout,
    Reward,
    Transition,
)

logger = logging.getLogger(__name__)

VARIABLE_TYPES = (str, int, float, bool)
# Recorded by openinference's instrumentors (OpenAI and LangChain alike) on LLM spans.
OUTPUT_TEXT_KEY = f"{SpanAttributes.LLM_OUTPUT_MESSAGES}.0.{MessageAttributes.MESSAGE_CONTENT}"
OUTPUT_ROLE_KEY = f"{SpanAttributes.LLM_OUTPUT_MESSAGES}.0.{MessageAttributes.MESSAGE_ROLE}"


@dataclass(frozen=True)
class AssemblyOptions:
    credit: str = "identical"
    gamma: float = 1.0
    air_rules: tuple[AirRule, ...] = ()
    rewards: RewardPolicy = RewardPolicy()
    retokenizer: Retokenizer | None = field(default=None, compare=False)


def is_llm_span(record: SpanRecord) -> bool:
    if record.span_kind == semconv.SPAN_KIND_LLM:
        return True
    return has_token_ids(record)


def has_token_ids(record: SpanRecord) -> bool:
    if semconv.LLM_PROMPT_TOKEN_IDS in record.attributes:
        return True
    return semconv.llm_response_token_ids(0) in record.attributes


class _Calls:
    """The kept LLM calls of a tree, and which call a span's signals belong to."""

    def __init__(self, tree: SpanTree) -> None:
        order = tree.order
        n = len(order)
        llm = [False] * n
        ids = [False] * n
        parent_pre = [-1] * n
        # In the order the records came (the store's start order), as they lie in memory, each
        # read once: in a 100k-span rollout every pass in tree order costs cache misses.
        for record in tree.by_key.values():
            i = record.pre
            if record.parent is not None:
                parent_pre[i] = record.parent.pre
            if is_llm_span(record):
                llm[i] = True
                ids[i] = has_token_ids(record)
        llm_below = [False] * n
        ids_below = [False] * n
        for i in range(n - 1, 0, -1):  # children come after parents in pre-order
            p = parent_pre[i]
            if p >= 0:
                llm_below[p] = llm_below[p] or llm[i] or llm_below[i]
                ids_below[p] = ids_below[p] or ids[i] or ids_below[i]
        kept: list[SpanRecord] = []
        suppressed_until = -1
        self.duplicates = 0
        for i, record in enumerate(order):
            if not llm[i]:
                continue
            if i < suppressed_until:
                self.duplicates += 1
                continue
            if not llm_below[i]:
                kept.append(record)
            elif ids[i] and not ids_below[i]:
                kept.append(record)
                suppressed_until = record.post
            else:
                self.duplicates += 1  # a wrapper of the calls below it
        # Positions for call_for_span include merged framework spans, so a signal that lands
        # on or after one of them is routed to the SDK call it merged into.
        self.merged_into = self._unnested_duplicates(kept)
        for key, same_call in same_call_by_response_id(kept, self.merged_into).items():  # the endpoint's span
            self.merged_into.setdefault(key, same_call)
        for key, target in self.merged_into.items():  # a framework span -> SDK span -> endpoint span
            while target.key in self.merged_into:
                target = self.merged_into[target.key]
            self.merged_into[key] = target
        self.token_id_mismatches = token_id_mismatches(order[i] for i in range(n) if ids[i])
        self.duplicates += len(self.merged_into)
        self.kept = [r for r in kept if r.key not in self.merged_into]
        self._index = kept
        self._pre = [r.pre for r in kept]
        self.by_response_id: dict[str, SpanRecord] = {}
        for i, record in enumerate(order):
            if not llm[i]:
                continue
            response_id = record.attributes.get(semconv.GENAI_RESPONSE_ID)
            if isinstance(response_id, str):
                call = self.call_for_span(record)
                if call is not None:
                    self.by_response_id.setdefault(response_id, call)

    @staticmethod
    def _unnested_duplicates(kept: list[SpanRecord]) -> dict[str, SpanRecord]:
        """Framework LLM spans (no token ids) that recorded the same call as an SDK span
        (with ids) without being its ancestor: key of the framework span -> the SDK span.

        openinference's LangChain tracer does not make its span current, so the OpenAI SDK
        span of the same call is not below it (often in another trace). The SDK span is the
        same call when it lies within the framework span's time window and both recorded the
        same output text. Timing only pairs the two records of one call here; it never
        decides which call a reward judges.
        """
        with_ids = sorted((r for r in kept if has_token_ids(r)), key=lambda r: r.start_ns)
        if not with_ids or len(with_ids) == len(kept):
            return {}
        starts = [r.start_ns for r in with_ids]
        merged: dict[str, SpanRecord] = {}
        claimed: set[str] = set()
        for record in kept:
            text = _output_text(record)
            if text is None or has_token_ids(record):
                continue
            position = bisect.bisect_left(starts, record.start_ns)
            while position < len(with_ids) and starts[position] <= record.end_ns:
                candidate = with_ids[position]
                if (candidate.key not in claimed and candidate.end_ns <= record.end_ns
                        and _output_text(candidate) == text):
                    merged[record.key] = candidate
                    claimed.add(candidate.key)
                    break
                position += 1
        return merged

    def call_for_span(self, record: SpanRecord) -> SpanRecord | None:
        found = self._positional_call(record)
        return None if found is None else self.merged_into.get(found.key, found)

    def _positional_call(self, record: SpanRecord) -> SpanRecord | None:
        pre = self._pre
        if not pre:
            return None
        last_inside = bisect.bisect_left(pre, record.post) - 1
        if last_inside >= 0 and pre[last_inside] >= record.pre:
            return self._index[last_inside]  # rules 1 and 2
        before = bisect.bisect_left(pre, record.pre) - 1
        if before >= 0:
            return self._index[before]  # rule 3
        after = bisect.bisect_left(pre, record.pre)
        return self._index[after] if after < len(pre) else None  # rule 4


def kept_calls(records: list[SpanRecord]) -> list[SpanRecord]:
    """The LLM calls of one rollout's spans, duplicates dropped as assembly drops them, in call order
    (``text_calls`` reads the text of those that came without token ids)."""
    return sorted(_Calls(SpanTree(records)).kept, key=lambda r: (r.start_ns, r.pre))


def _output_text(record: SpanRecord) -> str | None:
    """The first output message's text an instrumentor recorded on an LLM span, if any; "" for a
    message recorded without content (an empty reply, or one of tool calls only)."""
    text = record.attributes.get(OUTPUT_TEXT_KEY)
    if isinstance(text, str):
        return text
    return "" if isinstance(record.attributes.get(OUTPUT_ROLE_KEY), str) else None


def assemble_rollout(
    rollout_id: str,
    records: list[SpanRecord],
    end_reason: str,
    options: AssemblyOptions = AssemblyOptions(),
) -> AssembledRollout:
    """Assemble one rollout from its spans (any order). ``sequence`` is 0 until stored."""
    tree = SpanTree(records)
    problems = list(tree.problems)
    calls = _Calls(tree)
    if calls.duplicates:
        problems.append(
            f"{calls.duplicates} LLM span(s) recorded the same call as another span and were merged"
        )

    counters: Counter = Counter()
    for agent_span, endpoint_span in calls.token_id_mismatches:
        counters[COUNTER_TOKEN_ID_MISMATCHES] += 1
        problems.append(f"LLM span {agent_span.key} recorded other token ids than the endpoint's record"
                        f" {endpoint_span.key} of the same call; the endpoint's were used")
    rewards = event_rewards(tree, calls, options.rewards, problems, counters)
    rewards += _air_rewards(tree, calls, options.air_rules)
    reward_per_call: dict[str, float] = {}
    for reward in rewards:
        if reward.call_span_id is not None:
            reward_per_call[reward.call_span_id] = reward_per_call.get(reward.call_span_id, 0.0) + reward.value
    total_reward = sum(r.value for r in rewards) if rewards else None

    steps = _transition_steps(rollout_id, tree, calls, options.retokenizer, reward_per_call, problems)
    returns = credit_function(options.credit)([s["reward"] for s in steps], total_reward, options.gamma)
    transitions = tuple(
        Transition(index=i, return_=returns[i], **step) for i, step in enumerate(steps)
    )
    with_transition = {t.span_id for t in transitions}
    for call_id in reward_per_call:
        if call_id not in with_transition:
            problems.append(f"rewards attached to call {call_id}, which has no transition")
    unattached = [r for r in rewards if r.call_span_id is None]
    if unattached:
        problems.append(
            f"{len(unattached)} reward(s) judge no LLM call (the rollout has none);"
            " they count in total_reward only"
        )

    identity = _identity(tree)
    error, status_reason = rollout_status(tree, end_reason, total_reward)
    return AssembledRollout(
        rollout_id=rollout_id,
        task_id=identity.get(semconv.TASK_ID),
        attempt=identity.get(semconv.ATTEMPT),
        status=STATUS_FAILED if error is not None else STATUS_OK,
        error=error,
        status_reason=status_reason,
        end_reason=end_reason,
        total_reward=total_reward,
        rewards=tuple(rewards),
        variables=_variables(tree, problems),
        transitions=transitions,
        problems=tuple(problems),
        counters={name: count for name, count in sorted(counters.items()) if count},
        sequence=0,
    )


def _identity(tree: SpanTree) -> dict[str, Any]:
    identity: dict[str, Any] = {}
    for record in tree.order:  # the root first
        for key in (semconv.TASK_ID, semconv.ATTEMPT):
            if key not in identity and key in record.attributes:
                identity[key] = record.attributes[key]
        if len(identity) == 2:
            break
    return identity


def _air_rewards(tree: SpanTree, calls: _Calls, rules: tuple[AirRule, ...]) -> list[Reward]:
    if not rules:
        return []
    rewards: list[Reward] = []
    for record in tree.order:
        if record is tree.root:
            continue
        for rule in rules:
            if rule.matches(record):
                call = calls.call_for_span(record)
                rewards.append(
                    Reward(
                        name=rule.name, value=rule.reward, source=f"air:{rule.name}",
                        span_id=record.key, call_span_id=None if call is None else call.key,
                    )
                )
    return rewards


def _response_choices(attributes: dict[str, Any]) -> list[int]:
    choices = []
    i = 0
    while semconv.llm_response_token_ids(i) in attributes:
        choices.append(i)
        i += 1
    return choices


def _transition_steps(
    rollout_id: str,
    tree: SpanTree,
    calls: _Calls,
    retokenizer: Retokenizer | None,
    reward_per_call: dict[str, float],
    problems: list[str],
) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = []
    agent_names = AgentNames(tree, calls.merged_into)
    for call in sorted(calls.kept, key=lambda r: (r.start_ns, r.pre)):
        attributes = call.attributes
        prompt = attributes.get(semconv.LLM_PROMPT_TOKEN_IDS)
        choices = _response_choices(attributes)
        retokenized = attributes.get(semconv.LLM_RETOKENIZED) is True
        prompt = token_ids_of(prompt)
        responses = {i: token_ids_of(attributes[semconv.llm_response_token_ids(i)]) for i in choices}
        if prompt is None or not responses or any(r is None for r in responses.values()):
            if retokenizer is None:
                problems.append(
                    f"LLM call {call.key} ({call.name!r}) has no engine token ids; skipped"
                    " (allow re-tokenization with --retokenize-with TOKENIZER_DIR)"
                )
                continue
            try:
                prompt, response = retokenizer.retokenize(attributes)
            except RetokenizeError as exc:
                problems.append(f"LLM call {call.key} ({call.name!r}) could not be re-tokenized: {exc}")
                continue
            responses = {0: response}
            retokenized = True
        version = attributes.get(semconv.LLM_POLICY_VERSION)
        for choice, response_ids in responses.items():
            logprobs = logprobs_of(attributes.get(semconv.llm_response_logprobs(choice)))
            steps.append(
                dict(
                    rollout_id=rollout_id,
                    span_id=call.key,
                    agent_name=agent_names.for_call(call),
                    prompt_token_ids=tuple(prompt or ()),  # not None: checked above
                    response_token_ids=tuple(response_ids or ()),  # not None: checked above
                    response_logprobs=None if logprobs is None else tuple(float(x) for x in logprobs),
                    choice_index=choice,
                    policy_version=version if isinstance(version, int) else None,
                    reward=reward_per_call.get(call.key, 0.0),
                    retokenized=retokenized,
                )
            )
    return steps


def _variables(tree: SpanTree, problems: list[str]) -> dict[str, Any]:
    """``spanrl.variable.*`` of every span; when two spans set one, the later-ending wins."""
    prefix = semconv.VARIABLE_PREFIX
    found: dict[str, tuple[int, str, Any]] = {}
    for record in tree.by_key.values():  # arrival order (cache-friendly); ties broken by span id
        for key, value in record.attributes.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix):]
            if not isinstance(value, VARIABLE_TYPES):
                problems.append(f"variable {name!r} on span {record.key} is not a scalar; ignored")
                continue
            previous = found.get(name)
            if previous is None or (record.end_ns, record.key) >= previous[:2]:
                found[name] = (record.end_ns, record.key, value)
    return {name: found[name][2] for name in sorted(found)}
