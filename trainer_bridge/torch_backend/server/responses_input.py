"""A Responses API request's ``input`` as chat messages, the form ``chat_format`` renders.

Called by ``responses.py``. ``input`` is a string (one user message) or a list of items:
messages (``{"role", "content"}``, ``"type": "message"`` optional; ``developer`` is rendered as
``system``), earlier tool calls of the model (``function_call``: the ``tool_calls`` of an
assistant message, which the chat template renders) and their results (``function_call_output``:
a ``tool`` message). ``reasoning`` items are accepted and left out. Each item is validated on its
own, so a malformed one is a 400 naming its field (``input[2].call_id``).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from spanrl.trainer_bridge.torch_backend.server import chat_format
from spanrl.trainer_bridge.torch_backend.server.errors import InvalidRequestError
from spanrl.trainer_bridge.torch_backend.server.responses_protocol import (
    ITEM_MODELS,
    SKIPPED_ITEM_TYPES,
    TEXT_PART_TYPES,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    TextPart,
)
from spanrl.trainer_bridge.torch_backend.server.tool_calls import ToolCall

Message = dict[str, Any]


def instructions_messages(instructions: str | None) -> list[Message]:
    """The request's ``instructions`` as the conversation's first (system) message."""
    return [{"role": "system", "content": instructions}] if instructions else []


def input_messages(input_value: str | list[Any]) -> list[Message]:
    """The chat messages of a request's ``input`` (400 naming the field of a malformed item)."""
    if isinstance(input_value, str):
        return [{"role": "user", "content": input_value}]
    messages: list[Message] = []
    for position, raw in enumerate(input_value):
        where = f"input[{position}]"
        if not isinstance(raw, dict):
            raise InvalidRequestError(f"{where}: an input item is an object, got {type(raw).__name__}", param=where)
        item_type = raw.get("type", "message")
        if item_type in SKIPPED_ITEM_TYPES:
            continue
        model = ITEM_MODELS.get(item_type) if isinstance(item_type, str) else None
        if model is None:
            supported = ", ".join(sorted(ITEM_MODELS) + sorted(SKIPPED_ITEM_TYPES))
            raise InvalidRequestError(f"{where}.type: unsupported input item type {item_type!r}; this server "
                                      f"accepts {supported}", param=f"{where}.type")
        item = _validate(model, raw, where)
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text_of(item.content, f"{where}.content")})
        elif isinstance(item, FunctionCallItem):
            _append_tool_call(messages, ToolCall(item.call_id, item.name, item.arguments))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(chat_format.chat_message(chat_format.TOOL_ROLE, _text_of(item.output, f"{where}.output"),
                                                     tool_call_id=item.call_id))
    return messages


def _validate(model: type[Any], raw: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problem = exc.errors()[0]
        # the location of a union member (``str``, ``list[TextPart]``) is not a field name
        path = [str(p) for p in problem["loc"] if p not in ("str", "list[TextPart]")]
        field = where + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path)
        raise InvalidRequestError(f"{field}: {problem['msg']}", param=field) from exc


def _text_of(content: str | list[TextPart], where: str) -> str:
    """A content's text: the string, or its text parts joined (other part types carry none)."""
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(content):
        if part.type in TEXT_PART_TYPES:
            if part.text is None:
                raise InvalidRequestError(f"{where}[{index}].text: a {part.type} part needs a text",
                                          param=f"{where}[{index}].text")
            texts.append(part.text)
    return "".join(texts)


def _append_tool_call(messages: list[Message], call: ToolCall) -> None:
    """Tool calls made in one turn join that turn's assistant message, as chat's ``tool_calls``."""
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        earlier = [ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                   for c in last.get("tool_calls") or ()]
        messages[-1] = chat_format.chat_message("assistant", last.get("content") or None, [*earlier, call])
    else:
        messages.append(chat_format.chat_message("assistant", None, [call]))


__all__ = ["Message", "input_messages", "instructions_messages"]
