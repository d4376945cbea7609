"""Agent names from what frameworks record (otlp_receiver/agent_names.py), on span trees made
by the real OTel SDK and assembled as the receiver does (OTLP protobuf -> records -> assembly)."""

from __future__ import annotations

import json

from openinference.semconv.trace import OpenInferenceSpanKindValues, SpanAttributes

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.agent_names import GENAI_AGENT_NAME, framework_agent_name
from spanrl.otlp_receiver.assembly import assemble_rollout

LLM = {semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM}
AGENT = {semconv.OPENINFERENCE_SPAN_KIND: OpenInferenceSpanKindValues.AGENT.value}
OUT = "llm.output_messages.0.message.content"


def ids(prompt, response):
    return {semconv.LLM_PROMPT_TOKEN_IDS: prompt, semconv.llm_response_token_ids(0): response}


def names_of(memory_tracer, to_records):
    rollout = assemble_rollout("r", to_records(memory_tracer.exporter.get_finished_spans()), "explicit")
    return [(t.prompt_token_ids[0], t.agent_name) for t in rollout.transitions]


def test_precedence_of_the_framework_keys_on_one_span():
    langgraph = json.dumps({"langgraph_node": "node", "langgraph_step": 1})
    every = {GENAI_AGENT_NAME: "genai", SpanAttributes.AGENT_NAME: "oi-agent",
             SpanAttributes.GRAPH_NODE_ID: "graph-node", SpanAttributes.METADATA: langgraph}
    assert framework_agent_name(every) == "genai"
    del every[GENAI_AGENT_NAME]
    assert framework_agent_name(every) == "oi-agent"
    del every[SpanAttributes.AGENT_NAME]
    assert framework_agent_name(every) == "graph-node"
    del every[SpanAttributes.GRAPH_NODE_ID]
    assert framework_agent_name(every) == "node"
    # metadata without a node, not JSON, or not an object; an empty name is no name
    for metadata in ('{"ls_integration": "langgraph"}', "langgraph_node: x", '["langgraph_node"]'):
        assert framework_agent_name({SpanAttributes.METADATA: metadata}) is None
    assert framework_agent_name({GENAI_AGENT_NAME: "", SpanAttributes.AGENT_NAME: "b"}) == "b"


def test_the_nearest_agent_span_names_each_call(memory_tracer, to_records):
    """Agents SDK shape: agent span > turn > the SDK's response span > the OpenAI SDK call;
    a handed-off agent nested in another names the calls under it."""
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        with t.start_as_current_span("triage", attributes={**AGENT, SpanAttributes.AGENT_NAME: "triage",
                                                           SpanAttributes.GRAPH_NODE_ID: "triage"}):
            with t.start_as_current_span("turn"):
                with t.start_as_current_span("response", attributes=LLM):  # a wrapper: dropped
                    with t.start_as_current_span("Response", attributes={**LLM, **ids([1], [1])}):
                        pass
            with t.start_as_current_span("invoke_agent billing", attributes={GENAI_AGENT_NAME: "billing"}):
                with t.start_as_current_span("Response", attributes={**LLM, **ids([2], [2])}):
                    pass
        with t.start_as_current_span("Response", attributes={**LLM, **ids([3], [3])}):
            pass  # outside any agent
    assert names_of(memory_tracer, to_records) == [(1, "triage"), (2, "billing"), (3, None)]


def test_a_name_the_user_gave_beats_a_framework_name(memory_tracer, to_records):
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes={semconv.AGENT_NAME: "mine"}):
        with t.start_as_current_span("invoke_agent helper", attributes={GENAI_AGENT_NAME: "helper"}):
            with t.start_as_current_span("chat", attributes={**LLM, **ids([1], [1])}):
                pass
    assert names_of(memory_tracer, to_records) == [(1, "mine")]


def test_langgraph_node_of_the_framework_span_merged_into_the_call(memory_tracer, to_records):
    """openinference's LangChain tracer: the ChatOpenAI span (LangGraph's node in its metadata)
    is not an ancestor of the OpenAI SDK span of the same call (another trace); the receiver
    merges the two and the SDK call takes the node's name. A merged span without a name of its
    own takes its ancestors' (here the node's chain span, named by graph.node.id)."""
    t = memory_tracer.tracer
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        with t.start_as_current_span("LangGraph", attributes={SpanAttributes.METADATA: '{"ls_integration": "x"}'}):
            for number, node in enumerate(["planner", "solver"]):
                metadata = json.dumps({"langgraph_node": node, "langgraph_step": number + 1})
                with t.start_as_current_span(node, attributes={SpanAttributes.METADATA: metadata}):
                    framework = t.start_span("ChatOpenAI",
                                             attributes={**LLM, OUT: node, SpanAttributes.METADATA: metadata})
                    with t.start_as_current_span("ChatCompletion", context=None,
                                                 attributes={**LLM, OUT: node, **ids([number], [9])}):
                        pass
                    framework.end()
            with t.start_as_current_span("reviewer", attributes={SpanAttributes.GRAPH_NODE_ID: "reviewer"}):
                framework = t.start_span("ChatOpenAI", attributes={**LLM, OUT: "ok"})
                with t.start_as_current_span("ChatCompletion", context=None,
                                             attributes={**LLM, OUT: "ok", **ids([7], [9])}):
                    pass
                framework.end()
    assert names_of(memory_tracer, to_records) == [(0, "planner"), (1, "solver"), (7, "reviewer")]


def test_smolagents_names_an_agent_in_its_run_span_name(memory_tracer, to_records):
    """openinference's smolagents instrumentor: the run span is ``<agent name>.run`` (the class
    name for an agent without a name), an AGENT span with ``smolagents.*`` attributes; the model
    wrapper's LLM span is dropped for the OpenAI SDK span below it."""
    t = memory_tracer.tracer
    run = {**AGENT, "smolagents.max_steps": 1}
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        for number, span_name in enumerate(["planner.run", "CodeAgent.run"]):
            with t.start_as_current_span(span_name, attributes=run):
                with t.start_as_current_span("Step 1", attributes={semconv.OPENINFERENCE_SPAN_KIND: "CHAIN"}):
                    with t.start_as_current_span("OpenAIModel.generate", attributes=LLM):
                        with t.start_as_current_span("ChatCompletion", attributes={**LLM, **ids([number], [9])}):
                            pass
        with t.start_as_current_span("helper.run", attributes=AGENT):  # not smolagents': no name
            with t.start_as_current_span("ChatCompletion", attributes={**LLM, **ids([2], [9])}):
                pass
    assert names_of(memory_tracer, to_records) == [(0, "planner"), (1, "CodeAgent"), (2, None)]


def llama_index_step(event: str) -> dict:
    return {semconv.OPENINFERENCE_SPAN_KIND: "CHAIN",
            SpanAttributes.INPUT_VALUE: json.dumps({"ctx": "<Context object>", "ev": event})}


def test_llama_index_names_an_agent_in_its_step_event(memory_tracer, to_records):
    """openinference's LlamaIndex instrumentor records a workflow agent's step event (its repr)
    as the step span's input; the agent's name is the event's last field. Message text that
    looks like a name does not count."""
    t = memory_tracer.tracer
    tricky = "AgentSetup(input=[ChatMessage(text=\"current_agent_name='evil')\")], current_agent_name='solver')"
    with t.start_as_current_span(semconv.ROLLOUT_SPAN_NAME):
        for number, event in enumerate(["AgentSetup(input=[], current_agent_name='planner')", tricky]):
            with t.start_as_current_span("FunctionAgent.run", attributes={semconv.OPENINFERENCE_SPAN_KIND: "CHAIN"}):
                with t.start_as_current_span("BaseWorkflowAgent.run_agent_step", attributes=llama_index_step(event)):
                    with t.start_as_current_span("ChatCompletion", attributes={**LLM, **ids([number], [9])}):
                        pass
    assert names_of(memory_tracer, to_records) == [(0, "planner"), (1, "solver")]
    step = "BaseWorkflowAgent.run_agent_step"
    for value in ("not json", '["ev"]', json.dumps({"ev": 3}), json.dumps({"ev": "AgentSetup(input=[])"}),
                  json.dumps({"ev": "AgentSetup(current_agent_name='')"})):
        assert framework_agent_name({SpanAttributes.INPUT_VALUE: value}, step) is None
    assert framework_agent_name(llama_index_step("A(current_agent_name='x')"), "Other.run_step") is None
