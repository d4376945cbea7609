"""The policy server's HTTP bodies as typed pydantic models: requests and responses.

Used by every route module (``chat_completions.py``, ``completions.py``, ``models.py``,
``policy.py``) and by ``errors.py``; shaped like OpenAI's API with vLLM's extras
(``return_token_ids`` → ``prompt_token_ids`` and per-choice ``token_ids``) and spanrl's
``policy_version``. Every wire name of those extras comes from ``spanrl.instrumentation.semconv``
(as the field's wire alias); an extra is left out of a body when it was not asked for.

Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``, ``messages[].tool_calls``,
``messages[].tool_call_id``) and structured outputs (``response_format``) are implemented; the
replies' ``tool_calls`` are ``ToolCallOut`` (and, streamed, ``DeltaToolCall`` pieces).

Requests accept fields they do not implement (OpenAI clients send many): ``ignored_fields``
names them so the routes can log them, and ``REQUEST_FIELDS`` lists what is implemented and
what is known to be ignored (served in ``/v1/models``, documented in docs/policy.md).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from spanrl.instrumentation import semconv
from spanrl.trainer_bridge.torch_backend.server.token_id_form import TokenIdForm

# ----------------------------------------------------------------------------- requests


class _Lenient(BaseModel):
    # fields this server does not implement (tools, user...) are kept in ``model_extra``, not
    # rejected: agents that send them keep working; the routes log them (``ignored_fields``)
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ContentPart(_Lenient):
    type: str = "text"
    text: str = ""


class CalledFunction(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"  # a JSON string as OpenAI sends it; an object is accepted


class MessageToolCall(_Lenient):
    """An earlier call of the model, in an assistant message of the history."""

    id: str | None = None
    type: str = "function"
    function: CalledFunction


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer (not rendered: Qwen's templates do not)


class StreamOptions(_Lenient):
    include_usage: bool = False


class SamplingRequest(_Lenient, TokenIdForm):
    """The fields chat completions and completions share."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's; 0 or -1 = off (the default)
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = Field(False, validation_alias=semconv.REQUEST_RETURN_TOKEN_IDS)

    def ignored_fields(self) -> list[str]:
        """The request's fields this server ignores, as dotted names (``tools``,
        ``messages[].tool_calls``, ``messages[].content[].image_url``)."""
        return sorted(self.model_extra or ())


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # functions the model may call: {"type": "function", "function": {"name", "description", "parameters"}}
    # each, kept as sent (their key order is the prompt's)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "auto" (default with tools), "none", "required", a function
    parallel_tool_calls: bool | None = None  # false: at most one call is returned
    # {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}:
    # enforced by grammar-constrained decoding (structured_output.py)
    response_format: dict[str, Any] | None = None

    def ignored_fields(self) -> list[str]:
        names = set(super().ignored_fields())
        for message in self.messages:
            names.update(f"messages[].{name}" for name in message.model_extra or ())
            if isinstance(message.content, list):
                for part in message.content:
                    names.update(f"messages[].content[].{name}" for name in part.model_extra or ())
        return sorted(names)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool = False


class WeightsRequest(_Lenient):
    path: str
    version: int


# Fields OpenAI's (or vLLM's) API defines that this server accepts and ignores. Any other
# unknown field is ignored as well; every ignored field is logged once per server.
IGNORED_CHAT_FIELDS = (
    "functions", "function_call",
    "frequency_penalty", "presence_penalty", "logit_bias", "user", "metadata", "store", "service_tier",
    "reasoning_effort", "modalities", "audio", "prediction", "web_search_options",
    "messages[].name",
)
IGNORED_COMPLETION_FIELDS = (
    "best_of", "suffix", "frequency_penalty", "presence_penalty", "logit_bias", "user",
)


def implemented_fields(request_type: type[BaseModel]) -> list[str]:
    """The body fields ``request_type`` reads, by their wire names."""
    return sorted(field.validation_alias if isinstance(field.validation_alias, str) else name
                  for name, field in request_type.model_fields.items())


REQUEST_FIELDS: dict[str, dict[str, list[str]]] = {
    "/v1/chat/completions": {"implemented": implemented_fields(ChatCompletionRequest),
                             "ignored": sorted(IGNORED_CHAT_FIELDS)},
    "/v1/completions": {"implemented": implemented_fields(CompletionRequest),
                        "ignored": sorted(IGNORED_COMPLETION_FIELDS)},
}

# ----------------------------------------------------------------------------- responses


class ResponseModel(BaseModel):
    """Base of the response bodies. Fields are declared by their wire names or serialized under
    semconv's; those in ``omitted_when_none`` (the extras a request asks for) are left out of
    the body when unset, while OpenAI's own optional fields are sent as ``null``."""

    model_config = ConfigDict(populate_by_name=True)
    omitted_when_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _leave_out_unrequested_extras(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        for key in self.omitted_when_none:
            if key in data and data[key] is None:
                del data[key]
        return data

    def to_json(self) -> str:
        """The body as sent: wire names (semconv's aliases)."""
        return self.model_dump_json(by_alias=True)


_TOKEN_IDS = frozenset({semconv.RESPONSE_CHOICE_TOKEN_IDS, semconv.RESPONSE_PROMPT_TOKEN_IDS})


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[ChatLogprobToken]


class CompletionLogprobs(ResponseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class ToolCallFunction(ResponseModel):
    name: str
    arguments: str  # the JSON text the model wrote


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(ResponseModel):
    omitted_when_none = frozenset({"tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class DeltaFunction(ResponseModel):
    omitted_when_none = frozenset({"name", "arguments"})
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    """A streamed piece of a call: the first carries ``id``, ``type`` and the name, the rest
    fragments of the arguments (as vLLM and OpenAI stream them)."""

    omitted_when_none = frozenset({"id", "type"})
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class ChatCompletionChoice(ResponseModel):
    omitted_when_none = _TOKEN_IDS
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | str | None = Field(None, serialization_alias=semconv.RESPONSE_CHOICE_TOKEN_IDS)


class ChatCompletionResponse(ResponseModel):
    omitted_when_none = _TOKEN_IDS
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    prompt_token_ids: list[int] | str | None = Field(None, serialization_alias=semconv.RESPONSE_PROMPT_TOKEN_IDS)
    policy_version: int = Field(serialization_alias=semconv.RESPONSE_POLICY_VERSION)


class DeltaMessage(ResponseModel):
    omitted_when_none = frozenset({"role", "tool_calls"})
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionChunkChoice(ResponseModel):
    omitted_when_none = _TOKEN_IDS
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | str | None = Field(None, serialization_alias=semconv.RESPONSE_CHOICE_TOKEN_IDS)


class ChatCompletionChunk(ResponseModel):
    omitted_when_none = _TOKEN_IDS | {"usage"}
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | str | None = Field(None, serialization_alias=semconv.RESPONSE_PROMPT_TOKEN_IDS)
    policy_version: int = Field(serialization_alias=semconv.RESPONSE_POLICY_VERSION)


class CompletionChoice(ResponseModel):
    omitted_when_none = _TOKEN_IDS
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | str | None = Field(None, serialization_alias=semconv.RESPONSE_PROMPT_TOKEN_IDS)
    token_ids: list[int] | str | None = Field(None, serialization_alias=semconv.RESPONSE_CHOICE_TOKEN_IDS)


class CompletionResponse(ResponseModel):
    """A completion, and (as in OpenAI's API) each chunk of a streamed one."""

    omitted_when_none = frozenset({"usage"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    policy_version: int = Field(serialization_alias=semconv.RESPONSE_POLICY_VERSION)


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "spanrl"
    max_model_len: int
    # per route, the request fields implemented and those known to be ignored (REQUEST_FIELDS)
    request_fields: dict[str, dict[str, list[str]]] = Field(serialization_alias=semconv.RESPONSE_MODEL_REQUEST_FIELDS)


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


class WeightsResponse(ResponseModel):
    version: int
    model: str


class PolicyResponse(ResponseModel):
    """``GET /spanrl/v1/policy``: the serving version and model, and the engine's counters."""

    model_config = ConfigDict(extra="allow")
    version: int
    model: str
    stats: dict[str, Any] = Field(default_factory=dict)


__all__ = [
    "CalledFunction", "ChatCompletionRequest", "ChatMessage", "DeltaFunction", "DeltaToolCall", "MessageToolCall",
    "ToolCallFunction", "ToolCallOut", "CompletionRequest", "ContentPart", "SamplingRequest",
    "StreamOptions", "WeightsRequest", "IGNORED_CHAT_FIELDS", "IGNORED_COMPLETION_FIELDS", "REQUEST_FIELDS",
    "implemented_fields", "ResponseModel", "Usage", "TopLogprob", "ChatLogprobToken", "ChatLogprobs",
    "CompletionLogprobs", "AssistantMessage", "ChatCompletionChoice", "ChatCompletionResponse", "DeltaMessage",
    "ChatCompletionChunkChoice", "ChatCompletionChunk", "CompletionChoice", "CompletionResponse", "ModelCard",
    "ModelList", "ErrorInfo", "ErrorResponse", "WeightsResponse", "PolicyResponse",
]
