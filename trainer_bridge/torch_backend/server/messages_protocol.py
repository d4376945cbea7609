"""Anthropic's Messages API bodies (``POST /v1/messages``) as typed pydantic models.

Used by ``messages_translation.py`` (request → chat messages, engine result → ``Message``) and
``messages.py`` (the route and its stream of events). Shaped like Anthropic's API, with spanrl's
extras under semconv's names (as on the OpenAI routes): a request's ``return_token_ids`` asks for
``prompt_token_ids`` and ``token_ids`` on the message (streamed: on ``message_start``'s message and
on ``message_delta``), and every message carries the serving ``policy_version``. Fields the
server does not implement (``metadata``, ``thinking``, ``cache_control`` on blocks...) are kept
and ignored (logged once). The server never needs the ``anthropic`` package.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spanrl.instrumentation import semconv
from spanrl.trainer_bridge.torch_backend.server.protocol import ResponseModel
from spanrl.trainer_bridge.torch_backend.server.token_id_form import TokenIdForm

MESSAGES_PATH = "/v1/messages"


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ContentBlock(_Lenient):
    """One content block of a message: ``text``, ``tool_use`` (assistant), ``tool_result`` (user),
    or another type (images, thinking...), which this server does not read."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: Any = None  # tool_use: the call's arguments, an object
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


class InputMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class MessagesRequest(_Lenient, TokenIdForm):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    return_token_ids: bool = Field(False, validation_alias=semconv.REQUEST_RETURN_TOKEN_IDS)

    def ignored_fields(self) -> list[str]:
        """The request's fields this server ignores, as dotted names."""
        names = set(self.model_extra or ())
        for message in self.messages:
            if isinstance(message.content, list):
                for block in message.content:
                    names.update(f"messages[].content[].{name}" for name in block.model_extra or ())
        return sorted(names)


# Fields of Anthropic's API this server accepts and ignores (logged once per server).
IGNORED_MESSAGES_FIELDS = ("metadata", "thinking", "service_tier", "container", "mcp_servers",
                           "messages[].content[].cache_control", "system[].cache_control")
MESSAGES_REQUEST_FIELDS: dict[str, dict[str, list[str]]] = {
    MESSAGES_PATH: {"implemented": sorted(f.validation_alias if isinstance(f.validation_alias, str) else name
                                          for name, f in MessagesRequest.model_fields.items()),
                    "ignored": sorted(IGNORED_MESSAGES_FIELDS)},
}

# ----------------------------------------------------------------------------- responses

_TOKEN_IDS = frozenset({semconv.RESPONSE_PROMPT_TOKEN_IDS, semconv.RESPONSE_CHOICE_TOKEN_IDS})


class TextBlock(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(ResponseModel):
    input_tokens: int
    output_tokens: int


class Message(ResponseModel):
    """A reply (also the ``message`` of a stream's ``message_start``, its content then empty)."""

    omitted_when_none = _TOKEN_IDS
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock | ToolUseBlock]
    stop_reason: str | None = None  # end_turn | max_tokens | stop_sequence | tool_use
    stop_sequence: str | None = None
    usage: MessageUsage
    prompt_token_ids: list[int] | str | None = Field(None, serialization_alias=semconv.RESPONSE_PROMPT_TOKEN_IDS)
    token_ids: list[int] | str | None = Field(None, serialization_alias=semconv.RESPONSE_CHOICE_TOKEN_IDS)
    policy_version: int = Field(serialization_alias=semconv.RESPONSE_POLICY_VERSION)


class AnthropicErrorInfo(ResponseModel):
    type: str
    message: str


class AnthropicError(ResponseModel):
    """``{"type": "error", "error": {"type", "message"}}``: every error of this route."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


# The Anthropic error type of each HTTP status this server answers with.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> AnthropicError:
    return AnthropicError(error=AnthropicErrorInfo(type=ERROR_TYPES.get(status, "api_error"), message=message))


__all__ = ["AnthropicError", "AnthropicErrorInfo", "ContentBlock", "ERROR_TYPES", "IGNORED_MESSAGES_FIELDS",
           "InputMessage", "MESSAGES_PATH", "MESSAGES_REQUEST_FIELDS",
           "Message", "MessageUsage", "MessagesRequest", "TextBlock", "ToolUseBlock", "anthropic_error"]
