"""The text of a call an endpoint served, for its LLM span: the request's messages and tools and
the reply's text and tool calls, read from the OpenAI (or Anthropic) bodies as they passed.

Called by ``endpoint_spans.EndpointSpans.record`` (on its worker thread, off the serving path) for
a call whose ``ServedCall.request`` was kept (``spanrl proxy`` keeps every one: a hosted model
returns no token ids, and the text is then all there is to learn from). Chat completions and the
Responses API become ``otlp_receiver.call_text.ChatText`` (Responses ``instructions`` as the first,
system, message; ``function_call`` items as an assistant's ``tool_calls``; ``function_call_output``
as ``tool`` messages), and so do Anthropic's Messages (``system`` first; ``tool_use`` blocks as
``tool_calls``, ``tool_result`` blocks as ``tool`` messages; a stream's content blocks put
together); a text completion is ``input.value`` / ``output.value``. Streams are read chunk by
chunk (content and tool-call fragments concatenated). Lenient: what it does not know is left
out, nothing raises.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from openinference.semconv.trace import SpanAttributes

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.call_text import ChatText, to_attributes

CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MESSAGES_PATH = "/v1/messages"
_TEXT_PARTS = ("text", "input_text", "output_text")
_FINAL_RESPONSE_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def call_text_attributes(route: str, request: dict[str, Any], replies: list[dict[str, Any]]) -> dict[str, Any]:
    """Span attributes with the text of one call on ``route`` (empty for a route it does not know)."""
    attributes: dict[str, Any] = {}
    if isinstance(request.get("model"), str):
        attributes[SpanAttributes.LLM_MODEL_NAME] = request["model"]
    if route == COMPLETIONS_PATH:
        prompt = request.get("prompt")
        if isinstance(prompt, str):
            attributes[semconv.INPUT_VALUE] = prompt
        text = "".join(_choice_zero(reply).get("text") or "" for reply in replies)
        if replies:
            attributes[semconv.OUTPUT_VALUE] = text
        return attributes
    if route == CHAT_PATH:
        chat = ChatText([_chat_message(m) for m in request.get("messages") or () if isinstance(m, dict)],
                        _chat_tools(request.get("tools")), _chat_reply(replies))
    elif route == RESPONSES_PATH:
        chat = ChatText(_responses_messages(request), _responses_tools(request.get("tools")),
                        _responses_reply(replies))
    elif route == MESSAGES_PATH:
        chat = ChatText(_anthropic_messages(request), _anthropic_tools(request.get("tools")),
                        _anthropic_reply(replies))
    else:
        return attributes
    return {**attributes, **to_attributes(chat)}


def text_of(content: Any) -> str | None:
    """A message content's text: the string, or its text parts joined; None for none."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text") or "" for part in content
                       if isinstance(part, dict) and part.get("type", "text") in _TEXT_PARTS)
    return None


def _chat_message(message: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.get("role"), "content": text_of(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [call for call in message["tool_calls"] if isinstance(call, dict)]
    if isinstance(message.get("tool_call_id"), str):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    return [tool for tool in tools or () if isinstance(tool, dict)] if isinstance(tools, list) else []


def _choice_zero(reply: dict[str, Any]) -> dict[str, Any]:
    for choice in reply.get("choices") or ():
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return {}


def _chat_reply(replies: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The assistant message of choice 0: a whole body's, or a stream's deltas put together."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    seen = False
    for reply in replies:
        choice = _choice_zero(reply)
        whole = choice.get("message")
        if isinstance(whole, dict):
            return _chat_message({**whole, "role": "assistant"})
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            continue
        seen = True
        if isinstance(delta.get("content"), str):
            content.append(delta["content"])
        for fragment in delta.get("tool_calls") or ():
            if isinstance(fragment, dict):
                _add_call_fragment(calls.setdefault(int(fragment.get("index") or 0), {}), fragment)
    if not seen:
        return None
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) if content else None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def _add_call_fragment(call: dict[str, Any], fragment: dict[str, Any]) -> None:
    function = call.setdefault("function", {"name": "", "arguments": ""})
    call.setdefault("type", "function")
    if isinstance(fragment.get("id"), str):
        call["id"] = fragment["id"]
    part = fragment.get("function") or {}
    function["name"] += part.get("name") or ""
    function["arguments"] += part.get("arguments") or ""


def _responses_messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = request.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = request.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    return messages + _items_as_messages(items if isinstance(items, list) else [], input_side=True)


def _items_as_messages(items: Iterable[Any], input_side: bool) -> list[dict[str, Any]]:
    """Responses items as chat messages (a turn's function calls join one assistant message)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role") or "assistant", "content": text_of(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name") or "", "arguments": item.get("arguments") or ""}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and input_side:
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
    return messages


def _responses_tools(tools: Any) -> list[dict[str, Any]]:
    """Responses function tools (``{"type": "function", "name", ...}``) in chat form."""
    chat_tools = []
    for tool in tools if isinstance(tools, list) else ():
        if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("name"), str):
            function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
            chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _responses_reply(replies: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The reply of a Responses call (its final response object) as one assistant message."""
    response = None
    for reply in replies:
        if reply.get("object") == "response":
            response = reply
        elif reply.get("type") in _FINAL_RESPONSE_EVENTS and isinstance(reply.get("response"), dict):
            response = reply["response"]
    if response is None:
        return None
    messages = _items_as_messages(response.get("output") or (), input_side=False)
    merged: dict[str, Any] = {"role": "assistant", "content": None}
    for message in messages:
        if message.get("content"):
            merged["content"] = (merged["content"] or "") + message["content"]
        if message.get("tool_calls"):
            merged.setdefault("tool_calls", []).extend(message["tool_calls"])
    return merged


def _anthropic_messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    """A Messages request as chat messages: ``system`` first, each turn's blocks as chat writes them."""
    system = text_of(request.get("system"))
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for message in request.get("messages") or ():
        if not isinstance(message, dict):
            continue
        blocks = message.get("content")
        blocks = blocks if isinstance(blocks, list) else [{"type": "text", "text": blocks}]
        if message.get("role") == "assistant":
            messages.append(_anthropic_assistant(blocks))
            continue
        for block in blocks:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                 "content": text_of(block.get("content")) or ""})
        text = text_of([b for b in blocks if isinstance(b, dict) and b.get("type") == "text"])
        if text:
            messages.append({"role": "user", "content": text})
    return messages


def _anthropic_assistant(blocks: list[Any]) -> dict[str, Any]:
    """An assistant's content blocks as one chat message (``tool_use`` blocks as ``tool_calls``)."""
    text = text_of([b for b in blocks if isinstance(b, dict) and b.get("type") == "text"])
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    calls = [{"id": b.get("id"), "type": "function",
              "function": {"name": b.get("name") or "", "arguments": b["input"] if isinstance(b.get("input"), str)
                           else json.dumps(b.get("input") or {})}}
             for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
    if calls:
        message["tool_calls"] = calls
    return message


def _anthropic_tools(tools: Any) -> list[dict[str, Any]]:
    """Anthropic's custom tools (``name``, ``description``, ``input_schema``) in chat form."""
    return [{"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                              "parameters": tool.get("input_schema") or {}}}
            for tool in (tools if isinstance(tools, list) else ())
            if isinstance(tool, dict) and isinstance(tool.get("name"), str)]


def _anthropic_reply(replies: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The reply of a Messages call: a whole message's blocks, or a stream's blocks put together."""
    blocks: dict[int, dict[str, Any]] = {}
    for reply in replies:
        kind = reply.get("type")
        if kind == "message":
            return _anthropic_assistant(list(reply.get("content") or ()))
        index = reply.get("index")
        if kind == "content_block_start" and isinstance(index, int) and isinstance(reply.get("content_block"), dict):
            block = dict(reply["content_block"])
            if block.get("type") == "tool_use":
                block["input"] = ""  # the arguments' JSON text arrives in pieces
            blocks[index] = block
        elif kind == "content_block_delta" and index in blocks and isinstance(reply.get("delta"), dict):
            delta, block = reply["delta"], blocks[index]
            if delta.get("type") == "text_delta":
                block["text"] = (block.get("text") or "") + str(delta.get("text") or "")
            elif delta.get("type") == "input_json_delta":
                block["input"] += str(delta.get("partial_json") or "")
    if not blocks:
        return None
    return _anthropic_assistant([blocks[i] for i in sorted(blocks)])


__all__ = ["call_text_attributes", "text_of"]
