"""Assembly on span trees made by the real OTel SDK (InMemorySpanExporter -> OTLP -> records)."""

from __future__ import annotations

import json
import random

import pytest
from openinference.semconv.trace import OpenInferenceSpanKindValues
from opentelemetry.trace import Status, StatusCode

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.air import AirRuleError, load_rules
from spanrl.otlp_receiver.assembly import AssemblyOptions, assemble_rollout
from spanrl.otlp_receiver.rewards import RewardPolicy
from spanrl.otlp_receiver.span_tree import SpanTree

LLM = {semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM}
TOOL = {semconv.OPENINFERENCE_SPAN_KIND: OpenInferenceSpanKindValues.TOOL.value}


def ids(prompt, response, **extra):
    return {semconv.LLM_PROMPT_TOKEN_IDS: prompt, semconv.llm_response_token_ids(0): response, **extra}


def test_reward_attachment_rules(memory_tracer, to_records):
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME) as root:
        with t.start_as_current_span("step-1") as step:
            with t.start_as_current_span("llm-a", attributes={**LLM, **ids([1], [2])}) as a:
                a.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 0.5, semconv.REWARD_NAME: "format"})
            with t.start_as_current_span("llm-b", attributes={**LLM, **ids([3], [4])}):
                pass
            step.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 0.25})  # ancestor -> last call below
        with t.start_as_current_span("tool", attributes=TOOL) as tool:
            tool.add_event(semconv.GENAI_EVALUATION_EVENT, {semconv.GENAI_EVALUATION_SCORE: 0.125})
        with t.start_as_current_span(
            "llm-c", attributes={**LLM, **ids([5], [6]), semconv.GENAI_RESPONSE_ID: "chatcmpl-c"}
        ):
            pass
        with t.start_as_current_span("llm-d", attributes={**LLM, **ids([7], [8])}):
            pass
        with t.start_as_current_span("grader") as grader:
            grader.add_event(
                semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 2.0, semconv.REWARD_RESPONSE_ID: "chatcmpl-c"}
            )
        root.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 10.0, semconv.REWARD_NAME: "final"})
    evaluations_count = AssemblyOptions(rewards=RewardPolicy(evaluation_events=True))  # opted in
    rollout = assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), "rollout_span",
                               evaluations_count)
    assert [t.prompt_token_ids for t in rollout.transitions] == [(1,), (3,), (5,), (7,)]
    # llm-a: its own 0.5; llm-b: the step's 0.25 and the tool's evaluation 0.125 (the call that
    # led to the tool); llm-c: 2.0 by response id; llm-d: the root's 10.0 (the rollout's last call)
    assert [t.reward for t in rollout.transitions] == [0.5, 0.375, 2.0, 10.0]
    assert rollout.total_reward == pytest.approx(12.875)
    assert [t.return_ for t in rollout.transitions] == [pytest.approx(12.875)] * 4
    assert {r.name for r in rollout.rewards} == {"format", "reward", "evaluation", "final"}
    assert rollout.problems == ()


def test_rewards_follow_structure_not_timing(memory_tracer, to_records):
    """A reward emitted late (by time) on the first call's span still judges the first call."""
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        first = t.start_span("llm-1", attributes={**LLM, **ids([1], [1])})
        with t.start_as_current_span("llm-2", attributes={**LLM, **ids([2], [2])}):
            pass
        first.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 1.0})
        first.end()
    rollout = assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), "explicit")
    assert [t.reward for t in rollout.transitions] == [1.0, 0.0]


def test_duplicate_call_from_two_instrumentors_kept_once(memory_tracer, to_records):
    """A LangChain LLM span with the OpenAI LLM span (which has the token ids) under it."""
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        with t.start_as_current_span("ChatOpenAI", attributes=LLM) as outer:
            with t.start_as_current_span("ChatCompletion", attributes={**LLM, **ids([1, 2], [3])}):
                pass
            outer.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 1.0})
        # the other way round: ids on the outer span only -> the inner one is the duplicate
        with t.start_as_current_span("outer-with-ids", attributes={**LLM, **ids([4], [5])}):
            with t.start_as_current_span("inner-without", attributes=LLM):
                pass
    rollout = assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), "explicit")
    assert [(t.prompt_token_ids, t.response_token_ids) for t in rollout.transitions] == [((1, 2), (3,)), ((4,), (5,))]
    assert rollout.transitions[0].reward == 1.0
    assert any("2 LLM span(s) recorded the same call" in p for p in rollout.problems)
    assert not any("no engine token ids" in p for p in rollout.problems)


def test_unnested_framework_span_of_the_same_call_is_merged(memory_tracer, to_records):
    """openinference's LangChain span is not the current span, so the OpenAI SDK span of the
    same call is not below it (here: another trace). Same output text inside its time window
    = the same call; signals on the framework span go to the SDK call."""
    t = memory_tracer.tracer
    out = "llm.output_messages.0.message.content"
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        with t.start_as_current_span("chain"):
            for number, (prompt, reply) in enumerate([([1], "CALC 2+2"), ([1, 5], "ANSWER 4")]):
                framework = t.start_span("ChatOpenAI", attributes={**LLM, out: reply})
                with t.start_as_current_span("ChatCompletion", context=None,
                                             attributes={**LLM, out: reply,
                                                         **ids(prompt, [10 + number])}):
                    pass
                framework.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 0.25 * (number + 1)})
                framework.end()
            with t.start_as_current_span("unrelated-llm", attributes={**LLM, out: "other"}):
                pass  # no SDK twin with the same text: stays a call (and is reported)
    rollout = assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), "explicit")
    assert [t.response_token_ids for t in rollout.transitions] == [(10,), (11,)]
    assert [t.reward for t in rollout.transitions] == [0.25, 0.5]
    assert any("2 LLM span(s) recorded the same call" in p for p in rollout.problems)
    assert sum("no engine token ids" in p for p in rollout.problems) == 1  # the unrelated one


def test_out_of_order_orphans_and_virtual_root(memory_tracer, to_records):
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        with t.start_as_current_span("lost-parent"):
            for i in range(5):
                with t.start_as_current_span(f"llm-{i}", attributes=ids([i], [i])):
                    pass
    records = to_records(memory_tracer.exporter.get_finished_spans())
    random.Random(7).shuffle(records)
    without_parent = [r for r in records if r.name != "lost-parent"]
    rollout = assemble_rollout("r", without_parent, "idle_timeout")
    assert [t.prompt_token_ids for t in rollout.transitions] == [(i,) for i in range(5)]
    assert any("parent never arrived" in p for p in rollout.problems)
    no_root = [r for r in without_parent if r.name != semconv.ROLLOUT_SPAN_NAME]
    rollout = assemble_rollout("r", no_root, "idle_timeout")
    assert len(rollout.transitions) == 5 and rollout.end_reason == "idle_timeout"
    assert any("virtual root" in p for p in rollout.problems)


def test_parent_cycle_is_broken(memory_tracer, to_records):
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        with t.start_as_current_span("a"):
            with t.start_as_current_span("b", attributes=ids([1], [2])):
                pass
    records = {r.name: r for r in to_records(memory_tracer.exporter.get_finished_spans())}
    records["a"].parent_key = records["b"].key  # a <-> b
    tree = SpanTree(list(records.values()))
    assert len(tree.order) == 3 and tree.order[0].name == semconv.ROLLOUT_SPAN_NAME
    assert any("parent cycle" in p for p in tree.problems)
    rollout = assemble_rollout("r", list(records.values()), "explicit")
    assert len(rollout.transitions) == 1


def _reference_order(records, root_key):
    """Pre-order of the spans' tree as the module promises it, built here the plain way: children
    by (start, span id); a span whose parent is unknown hangs from the root, and so does the span
    of a parent cycle where a walk up from the spans, in arrival order, first meets itself."""
    by_key = {}
    for record in records:
        by_key.setdefault(record.key, record)  # the first of a span id wins
    parent = {key: r.parent_key if r.parent_key in by_key and r.parent_key != key else root_key
              for key, r in by_key.items() if key != root_key}
    done = {root_key}
    for start in parent:
        path, key = [], start
        while key not in done and key not in path:
            path.append(key)
            key = parent[key]
        if key in path:
            parent[key] = root_key
        done.update(path)
    children = {key: [] for key in by_key}
    for key, parent_key in parent.items():
        children[parent_key].append(by_key[key])
    order, stack = [], [by_key[root_key]]
    while stack:
        record = stack.pop()
        order.append(record.key)
        stack.extend(sorted(children[record.key], key=lambda r: (r.start_ns, r.key), reverse=True))
    return order


@pytest.mark.parametrize("seed", range(6))
def test_tree_order_matches_a_plain_reference_whatever_the_arrival(seed):
    """Random trees (ties in start time, orphans, a duplicate span id, a cycle on odd seeds),
    arriving shuffled; built twice from the same records, as a re-assembly does."""
    from spanrl.otlp_receiver.span_tree import SpanRecord

    rng = random.Random(seed)

    def record(key, parent_key, name="s"):
        return SpanRecord(key=key, trace_id="t", parent_key=parent_key, name=name, start_ns=rng.randrange(5),
                          end_ns=9, status_error=False, status_message="", attributes={}, events=[])

    records = [record("root", None, semconv.ROLLOUT_SPAN_NAME)]
    for i in range(60):
        parent = rng.choice(records).key if rng.random() > 0.1 else f"missing-{i}"
        records.append(record(f"s{i:02d}", parent))
    records.append(record("s05", "root"))  # the same span id again: the first one is kept
    if seed % 2:
        a, b = records[10], records[20]
        a.parent_key, b.parent_key = b.key, a.key
    rng.shuffle(records)
    expected = _reference_order(records, "root")
    for _ in range(2):
        tree = SpanTree(records)
        assert [r.key for r in tree.order] == expected
        assert all(r.pre == i for i, r in enumerate(tree.order))
        assert all(child.parent is r for r in tree.order for child in r.children)


def test_missing_token_ids_reported_not_retokenized(memory_tracer, to_records):
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        with t.start_as_current_span("text-only", attributes={**LLM, "input.value": "hi", "output.value": "yo"}):
            pass
    rollout = assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), "explicit")
    assert rollout.transitions == ()
    assert any("has no engine token ids; skipped" in p for p in rollout.problems)


def test_reward_without_any_call_counts_in_total_only(memory_tracer, to_records):
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME) as root:
        root.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 0.5})
        root.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: "high"})
    rollout = assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), "explicit")
    assert rollout.total_reward == 0.5 and rollout.transitions == ()
    assert rollout.rewards[0].call_span_id is None
    assert any("judge no LLM call" in p for p in rollout.problems)
    assert any("has no numeric value ('high')" in p for p in rollout.problems)


def test_retokenize_with_a_named_tokenizer(memory_tracer, to_records, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<|user|>": 1, "<|assistant|>": 2, "what": 3, "is": 4, "2": 5, "+": 6, "?": 7, "4": 8}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|user|>", "<|assistant|>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}<|assistant|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    from spanrl.otlp_receiver.retokenize import Retokenizer

    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        with t.start_as_current_span(
            "chat",
            attributes={
                **LLM, "llm.input_messages.0.message.role": "user",
                "llm.input_messages.0.message.content": "what is 2 + 2 ?",
                "llm.output_messages.0.message.content": "4",
            },
        ):
            pass
    options = AssemblyOptions(retokenizer=Retokenizer(str(tmp_path)))
    rollout = assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), "explicit", options)
    (transition,) = rollout.transitions
    assert transition.retokenized is True
    assert transition.prompt_token_ids == (1, 3, 4, 5, 6, 5, 7, 2)
    assert transition.response_token_ids == (8,)


def test_air_default_rule_and_rules_file(memory_tracer, to_records, tmp_path):
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        with t.start_as_current_span("llm-1", attributes={**LLM, **ids([1], [1])}):
            pass
        with t.start_as_current_span("search", attributes=TOOL) as tool:
            tool.set_status(Status(StatusCode.ERROR, "timeout"))
        with t.start_as_current_span("llm-2", attributes={**LLM, **ids([2], [2])}):
            pass
    records = to_records(memory_tracer.exporter.get_finished_spans())
    plain = assemble_rollout("r", records, "explicit")
    assert plain.total_reward is None and [t.return_ for t in plain.transitions] == [0.0, 0.0]
    rollout = assemble_rollout("r", records, "explicit", AssemblyOptions(air_rules=load_rules("default")))
    assert [t.reward for t in rollout.transitions] == [-0.1, 0.0]  # the call that led to the tool
    assert rollout.rewards[0].source == "air:tool_error" and rollout.total_reward == pytest.approx(-0.1)

    rules = tmp_path / "air.yaml"
    rules.write_text("rules:\n  - name: slow_search\n    reward: -1\n    when: {span_kind: tool, name: 'sea*'}\n")
    rollout = assemble_rollout(
        "r", records, "explicit",
        AssemblyOptions(air_rules=load_rules(str(rules)), credit="discounted", gamma=0.5),
    )
    assert [t.reward for t in rollout.transitions] == [-1.0, 0.0]
    assert [t.return_ for t in rollout.transitions] == [-1.0, 0.0]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rules": [{"name": "x", "reward": "high", "when": {"status": "ERROR"}}]}))
    with pytest.raises(AirRuleError, match="'reward' must be a finite number"):
        load_rules(str(bad))
    bad.write_text('{"rules": [{"name": "x", "reward": Infinity, "when": {"status": "ERROR"}}]}')
    with pytest.raises(AirRuleError, match="'reward' must be a finite number, got inf"):
        load_rules(str(bad))


def test_discounted_credit_and_variables_and_failure(memory_tracer, to_records):
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME) as root:
        for i in range(3):
            with t.start_as_current_span(
                f"llm-{i}", attributes={**LLM, **ids([i], [i]), semconv.AGENT_NAME: f"agent-{i % 2}",
                                        semconv.variable("step"): i}
            ) as call:
                call.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: float(i + 1)})
        root.set_attribute(semconv.variable("question"), "2+2?")
        root.set_status(Status(StatusCode.ERROR, "agent crashed"))
    records = to_records(memory_tracer.exporter.get_finished_spans())
    rollout = assemble_rollout("r", records, "rollout_span", AssemblyOptions(credit="discounted", gamma=0.5))
    # rewards 1, 2, 3: returns 3 ; 2 + 0.5*3 = 3.5 ; 1 + 0.5*3.5 = 2.75
    assert [t.return_ for t in rollout.transitions] == [2.75, 3.5, 3.0]
    assert [t.agent_name for t in rollout.transitions] == ["agent-0", "agent-1", "agent-0"]
    assert rollout.variables == {"step": 2, "question": "2+2?"}
    assert rollout.status == "failed" and rollout.error == "agent crashed"


def test_several_choices_become_several_transitions(memory_tracer, to_records):
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        with t.start_as_current_span(
            "n2", attributes={**LLM, **ids([1], [2]), semconv.llm_response_token_ids(1): [3, 4]}
        ):
            pass
    rollout = assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), "explicit")
    assert [(t.choice_index, t.response_token_ids) for t in rollout.transitions] == [(0, (2,)), (1, (3, 4))]
    assert [t.index for t in rollout.transitions] == [0, 1]
