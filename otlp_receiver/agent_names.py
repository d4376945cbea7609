"""Which agent made an LLM call, read from what the agent's frameworks already record.

Called by rollout assembly (``assembly._agent_name``) for each kept call; the name lands in
``Transition.agent_name``, which ``agents:`` in the train config selects on. No agent code is
needed: frameworks name their agents on their own spans, and the call's SDK span lies under them
(the OpenAI Agents SDK's and AutoGen's ``invoke_agent`` spans, CrewAI's agent spans) or
has a framework span of the same call merged into it (openinference's LangChain tracer, whose
LLM span carries LangGraph's node in its ``metadata``).

Resolution, over the call's *lineage* — the call span, the framework spans merged into it, then
the call's ancestors nearest first, then the merged spans' ancestors:
1. ``spanrl.agent.name`` (``spanrl.instrumentation.agent()``, or the resource's) on any span of
   the lineage, the nearest: a name the user gave beats one a framework inferred;
2. else the nearest span of the lineage carrying one of, in this order on one span:
   ``gen_ai.agent.name`` (OTel GenAI conventions), ``agent.name`` and ``graph.node.id``
   (OpenInference), ``langgraph_node`` in the OpenInference ``metadata`` JSON (LangGraph),
   or a name only in the span's name or input: openinference's smolagents instrumentor names
   an agent's run span ``<agent name>.run`` (its class name when the agent has none), and its
   LlamaIndex instrumentor records an agent step's event, ending in
   ``current_agent_name='<name>')``, as the step span's ``input.value``;
3. else none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping

from openinference.semconv.trace import SpanAttributes

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.span_tree import SpanRecord, SpanTree

GENAI_AGENT_NAME = "gen_ai.agent.name"
# Framework attributes naming an agent, in precedence order on one span.
FRAMEWORK_NAME_KEYS = (GENAI_AGENT_NAME, SpanAttributes.AGENT_NAME, SpanAttributes.GRAPH_NODE_ID)
LANGGRAPH_NODE_KEY = "langgraph_node"  # in the metadata LangGraph gives every run inside a node
SMOLAGENTS_RUN_KEY = "smolagents.max_steps"  # on the run span of openinference's smolagents instrumentor
SMOLAGENTS_RUN_SUFFIX = ".run"
LLAMA_INDEX_STEP_SUFFIX = ".run_agent_step"  # a LlamaIndex workflow agent's step (BaseWorkflowAgent)
_NOT_READ = object()  # a span whose nearest name was not looked for yet
# The end of the step's event as repr() writes it (the name is its last field; anchored at the end
# so that message text earlier in the event cannot pose as the name).
LLAMA_INDEX_AGENT_NAME = re.compile(r"""current_agent_name=(?:'([^'\\]*)'|"([^"\\]*)")\)\s*$""")


class AgentNames:
    """Agent names of one rollout's calls; built once per assembly (it caches per span)."""

    def __init__(self, tree: SpanTree, merged_into: Mapping[str, SpanRecord]) -> None:
        self._merged: dict[str, list[SpanRecord]] = {}
        for framework_key, call in merged_into.items():
            framework = tree.by_key.get(framework_key)
            if framework is not None:
                self._merged.setdefault(call.key, []).append(framework)
        # Per span, by its place in tree order, the name nearest it on its way up (itself
        # included): computed once for spans many calls share (the root, an agent's span), and in
        # lists, not dicts keyed by span id (a 100k-span rollout's dict costs a cache miss a lookup)
        self._nearest: dict[Callable[[SpanRecord], str | None], list] = {
            finder: [_NOT_READ] * len(tree.order) for finder in (_given_name, _framework_name)}

    def for_call(self, call: SpanRecord) -> str | None:
        heads = (call, *self._merged.get(call.key, ()))
        for finder in (_given_name, _framework_name):
            for record in heads:
                name = finder(record)
                if name is not None:
                    return name
            for record in heads:
                name = self._nearest_at_or_above(record.parent, finder)
                if name is not None:
                    return name
        return None

    def _nearest_at_or_above(self, node: SpanRecord | None, finder: Callable[[SpanRecord], str | None]) -> str | None:
        nearest = self._nearest[finder]
        path = []
        while node is not None and nearest[node.pre] is _NOT_READ:
            path.append(node)
            node = node.parent
        name = None if node is None else nearest[node.pre]
        for record in reversed(path):  # from the top down
            own = finder(record)
            if own is not None:
                name = own
            nearest[record.pre] = name
        return name


def _given_name(record: SpanRecord) -> str | None:
    """The name the user gave (``spanrl.agent.name``) on one span."""
    name = record.attributes.get(semconv.AGENT_NAME)
    return name if isinstance(name, str) and name else None


def _framework_name(record: SpanRecord) -> str | None:
    return framework_agent_name(record.attributes, record.name)


def framework_agent_name(attributes: Mapping[str, object], span_name: str = "") -> str | None:
    """The agent name a framework recorded on one span (its attributes, and its name), if any."""
    for key in FRAMEWORK_NAME_KEYS:
        name = attributes.get(key)
        if isinstance(name, str) and name:
            return name
    metadata = attributes.get(SpanAttributes.METADATA)
    if isinstance(metadata, str) and LANGGRAPH_NODE_KEY in metadata:
        try:
            node = json.loads(metadata).get(LANGGRAPH_NODE_KEY)
        except (ValueError, AttributeError):  # not JSON, or not a JSON object
            return None
        if isinstance(node, str) and node:
            return node
    return _name_in_span_name_or_input(attributes, span_name)


def _name_in_span_name_or_input(attributes: Mapping[str, object], span_name: str) -> str | None:
    """smolagents' run span (``<name>.run``) and LlamaIndex's step span (its event's
    ``current_agent_name``), as openinference's instrumentors record them."""
    if SMOLAGENTS_RUN_KEY in attributes and span_name.endswith(SMOLAGENTS_RUN_SUFFIX):
        return span_name[:-len(SMOLAGENTS_RUN_SUFFIX)] or None
    if span_name.endswith(LLAMA_INDEX_STEP_SUFFIX):
        step_input = attributes.get(SpanAttributes.INPUT_VALUE)
        event = _json_field(step_input, "ev") if isinstance(step_input, str) else None
        match = LLAMA_INDEX_AGENT_NAME.search(event) if event else None
        if match:
            return match.group(1) or match.group(2) or None
    return None


def _json_field(text: str, field: str) -> str | None:
    try:
        value = json.loads(text).get(field)
    except (ValueError, AttributeError):  # not JSON, or not a JSON object
        return None
    return value if isinstance(value, str) else None
