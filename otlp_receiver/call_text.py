"""The text of one LLM call as OpenInference span attributes, both ways.

Written by the policy endpoints' own spans (``trainer_bridge/endpoint_spans.py``: ``spanrl proxy``
records every call's text, since a hosted model returns no token ids) and read back by
``text_calls.py``, which turns a store's text-only calls into chat examples that ``spanrl sft
--store`` re-tokenizes with the student's tokenizer and chat template. OpenInference's
instrumentors write the same keys on agent-side spans, so their calls read back too.

A call is a ``ChatText``: the chat-completions messages the model saw (``role``, ``content``,
an assistant's ``tool_calls``, a tool message's ``tool_call_id``), the tools offered (chat form,
``{"type": "function", "function": {...}}``) and the reply (one assistant message). Keys:
``llm.input_messages.<i>.message.role|content|tool_call_id``,
``llm.input_messages.<i>.message.tool_calls.<j>.tool_call.id|function.name|function.arguments``,
the same under ``llm.output_messages.0``, and ``llm.tools.<i>.tool.json_schema`` (JSON).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from openinference.semconv.trace import (
    MessageAttributes,
    MessageContentAttributes,
    SpanAttributes,
    ToolAttributes,
    ToolCallAttributes,
)

INPUT = SpanAttributes.LLM_INPUT_MESSAGES
OUTPUT = SpanAttributes.LLM_OUTPUT_MESSAGES
ROLE, CONTENT = MessageAttributes.MESSAGE_ROLE, MessageAttributes.MESSAGE_CONTENT
TOOL_CALLS, TOOL_CALL_ID = MessageAttributes.MESSAGE_TOOL_CALLS, MessageAttributes.MESSAGE_TOOL_CALL_ID
CALL_ID = ToolCallAttributes.TOOL_CALL_ID
CALL_NAME = ToolCallAttributes.TOOL_CALL_FUNCTION_NAME
CALL_ARGUMENTS = ToolCallAttributes.TOOL_CALL_FUNCTION_ARGUMENTS_JSON
TOOL_SCHEMA_KEY = re.compile(
    rf"^{re.escape(SpanAttributes.LLM_TOOLS)}\.(\d+)\.{re.escape(ToolAttributes.TOOL_JSON_SCHEMA)}$")
_MESSAGE_KEY = re.compile(rf"^({re.escape(INPUT)}|{re.escape(OUTPUT)})\.(\d+)\.(.+)$")
_CALL_KEY = re.compile(rf"^{re.escape(TOOL_CALLS)}\.(\d+)\.(.+)$")
# content recorded as parts (openinference, for a list content): message.contents.<k>.message_content.text
_PART_TEXT_KEY = re.compile(rf"^{re.escape(MessageAttributes.MESSAGE_CONTENTS)}\.(\d+)\."
                            rf"{re.escape(MessageContentAttributes.MESSAGE_CONTENT_TEXT)}$")


@dataclass
class ChatText:
    """One call's text in chat-completions form: what the model saw, what it was offered, its reply."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    reply: dict[str, Any] | None = None  # {"role": "assistant", "content": str | None, "tool_calls"?: [...]}


def to_attributes(chat: ChatText) -> dict[str, Any]:
    """``chat`` as span attributes (strings only)."""
    attributes: dict[str, Any] = {}
    for index, message in enumerate(chat.messages):
        _put_message(attributes, f"{INPUT}.{index}", message)
    if chat.reply is not None:
        _put_message(attributes, f"{OUTPUT}.0", chat.reply)
    for index, tool in enumerate(chat.tools):
        attributes[f"{SpanAttributes.LLM_TOOLS}.{index}.{ToolAttributes.TOOL_JSON_SCHEMA}"] = json.dumps(tool)
    return attributes


def _put_message(attributes: dict[str, Any], prefix: str, message: dict[str, Any]) -> None:
    attributes[f"{prefix}.{ROLE}"] = str(message.get("role") or "user")
    if isinstance(message.get("content"), str):
        attributes[f"{prefix}.{CONTENT}"] = message["content"]
    if isinstance(message.get("tool_call_id"), str):
        attributes[f"{prefix}.{TOOL_CALL_ID}"] = message["tool_call_id"]
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or {}
        where = f"{prefix}.{TOOL_CALLS}.{index}."
        if isinstance(call.get("id"), str):
            attributes[where + CALL_ID] = call["id"]
        attributes[where + CALL_NAME] = str(function.get("name") or "")
        arguments = function.get("arguments")
        attributes[where + CALL_ARGUMENTS] = arguments if isinstance(arguments, str) else json.dumps(arguments or {})


def from_attributes(attributes: dict[str, Any]) -> ChatText:
    """The ``ChatText`` a span's attributes hold (empty messages and no reply when none were recorded)."""
    found: dict[str, dict[int, dict[str, Any]]] = {INPUT: {}, OUTPUT: {}}
    tools: dict[int, dict[str, Any]] = {}
    for key, value in attributes.items():
        match = _MESSAGE_KEY.match(key)
        if match is not None:
            message = found[match.group(1)].setdefault(int(match.group(2)), {})
            _read_message_field(message, match.group(3), value)
            continue
        tool = TOOL_SCHEMA_KEY.match(key)
        if tool is not None and isinstance(value, str):
            try:
                schema = json.loads(value)
            except json.JSONDecodeError:
                continue
            if isinstance(schema, dict):
                tools[int(tool.group(1))] = schema
    messages = [_finish(m) for _, m in sorted(found[INPUT].items())]
    outputs = [_finish(m) for _, m in sorted(found[OUTPUT].items())]
    return ChatText(messages, [t for _, t in sorted(tools.items())], outputs[0] if outputs else None)


def _read_message_field(message: dict[str, Any], name: str, value: Any) -> None:
    if name == ROLE and isinstance(value, str):
        message["role"] = value
    elif name == CONTENT and isinstance(value, str):
        message["content"] = value
    elif name == TOOL_CALL_ID and isinstance(value, str):
        message["tool_call_id"] = value
    elif isinstance(value, str):
        call = _CALL_KEY.match(name)
        if call is not None:
            message.setdefault("_calls", {}).setdefault(int(call.group(1)), {})[call.group(2)] = value
        part = _PART_TEXT_KEY.match(name)
        if part is not None:
            message.setdefault("_parts", {})[int(part.group(1))] = value


def _finish(message: dict[str, Any]) -> dict[str, Any]:
    """A message read back, in chat-completions form."""
    calls = message.pop("_calls", {})
    parts = message.pop("_parts", {})
    message.setdefault("role", "user")
    message.setdefault("content", "".join(text for _, text in sorted(parts.items())) if parts else None)
    if calls:
        message["tool_calls"] = [
            {"id": call.get(CALL_ID) or f"call_{index}", "type": "function",
             "function": {"name": call.get(CALL_NAME, ""), "arguments": call.get(CALL_ARGUMENTS, "{}")}}
            for index, call in sorted(calls.items())]
    return message


__all__ = ["ChatText", "from_attributes", "to_attributes"]
