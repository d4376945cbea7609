"""The Responses API's HTTP bodies (``POST /v1/responses``) as typed pydantic models.

Used by ``responses.py`` (the route) and ``models.py`` (``RESPONSES_REQUEST_FIELDS``); kept out
of ``protocol.py``, which holds the chat and completions bodies, to keep both small. Shaped like
OpenAI's Responses API with vLLM's extras on that route: ``enable_response_messages`` asks for
``input_messages`` / ``output_messages``, each a list of ``{"type": "raw_message_tokens",
"message": text, "tokens": ids}`` (the prompt's and the sampled ids), and
``include: ["message.output_text.logprobs"]`` puts logprobs on each ``output_text`` part; and
spanrl's ``policy_version``.

The request's ``input`` items stay plain dicts here: ``responses.py`` validates each one with the
item models below, so a malformed item is a 400 naming its field (``input[2].call_id``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from spanrl.instrumentation import semconv
from spanrl.trainer_bridge.torch_backend.server.protocol import ResponseModel, implemented_fields
from spanrl.trainer_bridge.torch_backend.server.token_id_form import TokenIdForm

INCLUDE_OUTPUT_LOGPROBS = "message.output_text.logprobs"

# ----------------------------------------------------------------------------- requests


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ResponsesRequest(_Lenient, TokenIdForm):
    model: str
    input: str | list[Any]  # items are validated one by one (responses_input.py)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] | None = None
    # vLLM's extras on this route
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    enable_response_messages: bool = Field(False, validation_alias=semconv.REQUEST_ENABLE_RESPONSE_MESSAGES)
    # function tools, {"type": "function", "name", "description", "parameters"} each (kept as sent)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "auto", "none", "required", {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    # {"format": {"type": "text" | "json_object"}} or {"format": {"type": "json_schema", "name", "schema",
    # "strict"}}: enforced by grammar-constrained decoding (structured_output.py)
    text: dict[str, Any] | None = None

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or ())

    @property
    def wants_logprobs(self) -> bool:
        return INCLUDE_OUTPUT_LOGPROBS in (self.include or ())


class TextPart(_Lenient):
    """A text part of a message item's content (the other part types carry no text here)."""

    type: str
    text: str | None = None


class MessageItem(_Lenient):
    """``{"role": ..., "content": ...}``, with or without ``"type": "message"``."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(_Lenient):
    """A tool call the model made earlier in the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Lenient):
    """What the agent's tool returned for ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text"})
# Item types accepted and left out of the prompt: this server's models emit no reasoning items.
SKIPPED_ITEM_TYPES = frozenset({"reasoning"})
ITEM_MODELS: dict[str, type[_Lenient]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
}

# Fields OpenAI's Responses API defines that this server accepts and ignores (logged once).
IGNORED_RESPONSES_FIELDS = (
    "max_tool_calls", "reasoning", "truncation",
    "user", "service_tier", "background", "prompt", "prompt_cache_key", "safety_identifier", "conversation",
)
RESPONSES_REQUEST_FIELDS: dict[str, dict[str, list[str]]] = {
    "/v1/responses": {"implemented": implemented_fields(ResponsesRequest),
                      "ignored": sorted(IGNORED_RESPONSES_FIELDS)},
}

# ----------------------------------------------------------------------------- responses


class LogprobTop(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class OutputLogprob(LogprobTop):
    top_logprobs: list[LogprobTop] = Field(default_factory=list)


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[OutputLogprob] | None = None


class OutputMessage(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(ResponseModel):
    """A tool call the model made: ``arguments`` is the JSON text it wrote."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int) -> ResponseUsage:
        return cls(input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=input_tokens + output_tokens)


class RawMessageTokens(ResponseModel):
    """vLLM's ``input_messages`` / ``output_messages`` entry: a text and its exact ids."""

    type: Literal["raw_message_tokens"] = "raw_message_tokens"
    message: str
    tokens: list[int] | str = Field(serialization_alias=semconv.RESPONSE_MESSAGE_TOKENS)


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(ResponseModel):
    code: str
    message: str


class ResponsesResponse(ResponseModel):
    omitted_when_none: ClassVar[frozenset[str]] = frozenset(
        {semconv.RESPONSE_INPUT_MESSAGES, semconv.RESPONSE_OUTPUT_MESSAGES})
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    model: str
    output: list[OutputMessage | OutputFunctionCall] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    input_messages: list[RawMessageTokens] | None = Field(None, serialization_alias=semconv.RESPONSE_INPUT_MESSAGES)
    output_messages: list[RawMessageTokens] | None = Field(None, serialization_alias=semconv.RESPONSE_OUTPUT_MESSAGES)
    policy_version: int = Field(serialization_alias=semconv.RESPONSE_POLICY_VERSION)


class StreamEvent(ResponseModel):
    """One server-sent event of a streamed response; the other fields depend on ``type``."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


__all__ = [
    "FunctionCallItem", "FunctionCallOutputItem", "IGNORED_RESPONSES_FIELDS", "INCLUDE_OUTPUT_LOGPROBS",
    "ITEM_MODELS", "IncompleteDetails", "InputTokensDetails", "LogprobTop", "MessageItem", "OutputLogprob",
    "OutputFunctionCall", "OutputMessage", "OutputText", "OutputTokensDetails", "RESPONSES_REQUEST_FIELDS",
    "RawMessageTokens", "ResponseError", "ResponseUsage", "ResponsesRequest", "ResponsesResponse",
    "SKIPPED_ITEM_TYPES", "StreamEvent", "TEXT_PART_TYPES", "TextPart",
]
