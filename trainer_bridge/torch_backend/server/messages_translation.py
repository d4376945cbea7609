"""Between Anthropic's Messages API and the server's chat path: requests in, messages out.

Torch-free; used by ``messages.py`` (the ``/v1/messages`` route). A request becomes what
``/v1/chat/completions`` renders: ``system`` (a string or text blocks) the system message; each
message's ``text`` blocks its content, an assistant's ``tool_use`` blocks its ``tool_calls``
(``input`` written as JSON), a user's ``tool_result`` blocks ``tool`` messages (before the
message's text, in order); ``tools`` (``name``, ``description``, ``input_schema``) the function
tools the chat template renders; ``tool_choice`` (``auto``, ``any``, ``tool`` + ``name``,
``none``; ``disable_parallel_tool_use``) the chat ``tool_choice``; a last assistant message is a
prefill the reply continues. The engine's reply becomes content blocks (``text``, ``tool_use``
with the parsed ``input``) and a ``stop_reason``: ``end_turn``, ``max_tokens``, ``stop_sequence``
(with the one that matched) or ``tool_use``. Bad input is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from spanrl.trainer_bridge.torch_backend.engine.requests import SamplingParams
from spanrl.trainer_bridge.torch_backend.server.errors import InvalidRequestError
from spanrl.trainer_bridge.torch_backend.server.messages_protocol import (
    ContentBlock,
    MessagesRequest,
    TextBlock,
    ToolUseBlock,
)
from spanrl.trainer_bridge.torch_backend.server.tool_calls import ParsedReply, ToolChoiceError, ToolSetup, tool_setup

READ_BLOCKS = frozenset({"text", "tool_use", "tool_result"})


def block_text(content: str | list[ContentBlock] | list[dict[str, Any]] | None) -> str:
    """The text of a string or of text blocks (dicts or ``ContentBlock``), joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else block.type
        text = block.get("text") if isinstance(block, dict) else block.text
        if kind == "text" and isinstance(text, str):
            texts.append(text)
    return "".join(texts)


def unread_block_types(body: MessagesRequest) -> list[str]:
    """The content block types of the request this server does not read (images, thinking...)."""
    found: set[str] = set()
    for message in body.messages:
        if isinstance(message.content, list):
            found.update(f"messages[].content[].{b.type}" for b in message.content if b.type not in READ_BLOCKS)
    return sorted(found)


def chat_messages(body: MessagesRequest) -> tuple[list[dict[str, Any]], str]:
    """The request as chat messages (the form ``chat_format.render_chat`` takes), and the prefill:
    the text of a last assistant message, which the reply continues ("" when there is none)."""
    messages: list[dict[str, Any]] = []
    system = block_text(body.system)
    if system:
        messages.append({"role": "system", "content": system})
    history = list(body.messages)
    prefill = ""
    if history[-1].role == "assistant":
        last = history.pop()
        if isinstance(last.content, list) and any(b.type == "tool_use" for b in last.content):
            raise InvalidRequestError("messages: the last message is an assistant message with tool_use blocks; "
                                      "answer its calls with a user message of tool_result blocks",
                                      param=f"messages[{len(body.messages) - 1}]")
        prefill = block_text(last.content)
    for index, message in enumerate(history):
        if message.role == "assistant":
            messages.append(assistant_message(index, message.content))
        else:
            messages.extend(user_messages(index, message.content))
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequestError("messages: the request has no user message to answer", param="messages")
    return messages, prefill


def assistant_message(index: int, content: str | list[ContentBlock]) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    calls = []
    for position, block in enumerate(content):
        if block.type != "tool_use":
            continue
        if not block.name or not isinstance(block.input, dict):
            raise InvalidRequestError("a tool_use block needs a name and an input object",
                                      param=f"messages[{index}].content[{position}]")
        calls.append({"id": block.id, "type": "function",
                      "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
    message: dict[str, Any] = {"role": "assistant", "content": block_text(content)}
    if calls:
        message["tool_calls"] = calls
    return message


def user_messages(index: int, content: str | list[ContentBlock]) -> list[dict[str, Any]]:
    """A user message: one ``tool`` message per ``tool_result`` block, then its text (if any)."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    messages: list[dict[str, Any]] = []
    for position, block in enumerate(content):
        if block.type == "tool_use":
            raise InvalidRequestError("tool_use blocks belong in assistant messages",
                                      param=f"messages[{index}].content[{position}]")
        if block.type == "tool_result":
            if not block.tool_use_id:
                raise InvalidRequestError("a tool_result block needs the tool_use_id it answers",
                                          param=f"messages[{index}].content[{position}].tool_use_id")
            result = block_text(block.content)
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                             "content": f"Error: {result}" if block.is_error else result})
    text = block_text(content)
    if text or not messages:
        messages.append({"role": "user", "content": text})
    return messages


def request_tool_setup(body: MessagesRequest) -> ToolSetup:
    """The request's tools in the chat-completions form the template renders, and what its
    ``tool_choice`` asks for (400 naming the field)."""
    tools = []
    for index, tool in enumerate(body.tools or ()):
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise InvalidRequestError(f"tools[{index}]: this server offers custom tools only, {{\"name\": ..., "
                                      "\"description\": ..., \"input_schema\": {...}}", param=f"tools[{index}]")
        function = {"name": tool["name"], "description": tool.get("description", ""),
                    "parameters": tool["input_schema"]}
        tools.append({"type": "function", "function": function})
    choice, parallel = chat_tool_choice(body.tool_choice)
    try:
        return tool_setup(tools, choice, parallel, strict=frozenset())
    except ToolChoiceError as exc:
        raise InvalidRequestError(str(exc), param="tool_choice") from exc


def chat_tool_choice(tool_choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """Anthropic's ``tool_choice`` as chat's, and whether parallel calls are allowed."""
    if tool_choice is None:
        return None, None
    kind = tool_choice.get("type")
    parallel = False if tool_choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(tool_choice.get("name"), str):
        return {"type": "function", "function": {"name": tool_choice["name"]}}, parallel
    raise InvalidRequestError("tool_choice must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} "
                              "or {\"type\": \"tool\", \"name\": ...}", param="tool_choice")


def sampling_params(body: MessagesRequest) -> SamplingParams:
    stops = tuple(body.stop_sequences or ())
    if any(not stop for stop in stops):
        raise InvalidRequestError("stop_sequences must not hold empty strings", param="stop_sequences")
    top_k = body.top_k if body.top_k is not None else 0
    return SamplingParams(
        max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=0 if top_k == -1 else top_k, n=1, stop=stops)


def matched_stop(tokenizer: Any, token_ids: list[int], text: str, stops: tuple[str, ...]) -> str | None:
    """The stop sequence that ended a reply whose text (cut before it) is ``text``, or None when
    the reply ended on its own (an end-of-sequence token)."""
    if not stops:
        return None
    full = tokenizer.decode(token_ids, skip_special_tokens=True)
    return next((stop for stop in stops if full.startswith(stop, len(text))), None)


def stop_reason(finish_reason: str | None, called: bool, stop_sequence: str | None) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def call_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object ({} when they are not one: a reply cut short)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(reply: ParsedReply) -> list[TextBlock | ToolUseBlock]:
    """A parsed reply as content blocks: its text (if any), then one ``tool_use`` per call."""
    blocks: list[TextBlock | ToolUseBlock] = []
    text = reply.content or ""
    if text:
        blocks.append(TextBlock(text=text))
    blocks.extend(ToolUseBlock(id=call.id.replace("call_", "toolu_", 1), name=call.name,
                               input=call_input(call.arguments)) for call in reply.tool_calls)
    return blocks


__all__ = ["block_text", "call_input", "chat_messages", "chat_tool_choice", "content_blocks", "matched_stop",
           "request_tool_setup", "sampling_params", "stop_reason", "unread_block_types"]
