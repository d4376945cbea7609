"""What a relay changes in the bodies passing through it, and its error bodies (OpenAI's; Anthropic's
on ``/v1/messages``).

Used by ``app.py`` and ``forwarding.py``, as ``RelayConfig`` says. On the way in
(``rewrite_request``): the agent's model name becomes the upstream's (the gateway) or a fixed one
(a proxy's ``upstream_model``); the temperature is pinned when the relay is told to (the trainer
recomputes log-probs at that temperature); and either ``return_token_ids`` and logprobs are asked
for (``enable_response_messages`` on ``/v1/responses``, ``return_token_ids`` on Anthropic's
``/v1/messages``, which spanrl's server answers with the ids; logprobs not for a grammar-constrained
request: ``constrains_output``), so every span carries the engine's token ids whatever the agent
asked, or, for an upstream that does not speak vLLM's dialect (a hosted API), those vLLM-only
fields are removed. On the way out (``rewrite_reply``, ``rewrite_sse_event``): the model name goes
back to the one the agent used (``answer_as``, set per request: a relay may answer any name) and
the top-level ``policy_version`` is set, as spanrl's embedded server writes them, and the ids are
packed when the agent asked for that form (``packed_replies``). Structured-output
fields (``response_format``, ``text.format``, ``tools``' ``strict``, ``tool_choice``) pass
unchanged: the upstream (vLLM) enforces them itself.
"""

from __future__ import annotations

import json
import logging
import threading
from contextvars import ContextVar
from typing import Any

from spanrl.bridge_protocol import is_validation_rollout
from spanrl.instrumentation import semconv
from spanrl.trainer_bridge.relay import spans
from spanrl.trainer_bridge.relay.config import RelayConfig
from spanrl.trainer_bridge.relay.packed_replies import pack_reply_ids

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API, relayed to upstreams that speak it (spanrl's)
GENERATION_PATHS = (CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH, MESSAGES_PATH)
# request fields only vLLM (and spanrl's server) know; removed for other upstreams
VLLM_ONLY_FIELDS = (semconv.REQUEST_RETURN_TOKEN_IDS, semconv.REQUEST_ENABLE_RESPONSE_MESSAGES)

SSE_DATA_PREFIX = "data:"
SSE_DONE_PAYLOAD = "[DONE]"


class _OnceFlag:
    """True the first time it is asked, in this process (a warning said once, not per call)."""

    def __init__(self) -> None:
        self._done = False
        self._lock = threading.Lock()

    def first(self) -> bool:
        with self._lock:
            first, self._done = not self._done, True
        return first


_TEMPERATURE_OVERRIDE_WARNING = _OnceFlag()
# the model name the current request asked for; its reply (each stream event too) carries it back
_answered_name: ContextVar[str | None] = ContextVar("spanrl_relay_model_name", default=None)


def answer_as(name: str) -> None:
    """The current request's replies carry ``name`` as their ``model``; it also goes on the
    request's span (``gen_ai.request.model``)."""
    _answered_name.set(name)
    spans.note_request_model(name)


def rewrite_request(body: dict[str, Any], path: str, config: RelayConfig, upstream_model: str | None,
                    rollout_id: str = "") -> dict[str, Any]:
    """The body sent upstream for an agent's ``body`` on ``path`` (the agent's dict is not changed).
    ``upstream_model``: the upstream's own model name (asked when the relay has a served name)."""
    payload = dict(body)
    payload.pop(semconv.TOKEN_IDS_FORM_FIELD, None)  # the relay's own to answer (packed_replies), not the upstream's
    if config.served_model_name is not None and upstream_model is not None:
        payload["model"] = upstream_model
    elif config.upstream_model:
        payload["model"] = config.upstream_model
    if config.temperature is not None:
        asked = payload.get("temperature")
        if asked is not None and asked != config.temperature and _TEMPERATURE_OVERRIDE_WARNING.first():
            logger.warning("%s: an agent asked for temperature %s; every request is sampled at %s, the "
                           "temperature the trainer computes log-probs at (said once per process)", config.name,
                           asked, config.temperature)
        payload["temperature"] = config.temperature
    if config.validation_temperature is not None and is_validation_rollout(rollout_id):
        payload["temperature"] = config.validation_temperature  # not trained on: any temperature
    if not config.ask_token_ids:
        for name in VLLM_ONLY_FIELDS:
            payload.pop(name, None)
    elif path == CHAT_PATH:
        payload[semconv.REQUEST_RETURN_TOKEN_IDS] = True
        if not payload.get("logprobs") and not constrains_output(body):
            payload["logprobs"] = True
    elif path == COMPLETIONS_PATH:
        payload[semconv.REQUEST_RETURN_TOKEN_IDS] = True
        if payload.get("logprobs") is None:
            payload["logprobs"] = 0  # the sampled token's logprob, no alternatives
    elif path == RESPONSES_PATH:
        payload[semconv.REQUEST_ENABLE_RESPONSE_MESSAGES] = True
    elif path == MESSAGES_PATH:
        payload[semconv.REQUEST_RETURN_TOKEN_IDS] = True  # spanrl's server: on the message / its stream's events
    return payload


def constrains_output(body: dict[str, Any]) -> bool:
    """Whether vLLM decodes this chat request under a grammar (``response_format`` JSON, a forced
    tool call, vLLM's ``structured_outputs``). vLLM's logprobs of such a request are of the
    masked logits (renormalized over the allowed tokens), not the policy's: the relay does not
    ask for them, so the update recomputes the old log-probs with verl's actor (docs/policy.md)."""
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in ("json_object", "json_schema"):
        return True
    tool_choice = body.get("tool_choice")
    return tool_choice == "required" or isinstance(tool_choice, dict) or bool(body.get("structured_outputs"))


def rewrite_reply(data: Any, served_model: str | None, version: int | None, stream_event: bool = False) -> Any:
    """A successful JSON reply (or one stream event's data) as the agent gets it: its model name
    (the one its request asked for, when the relay changed it), the policy version, its ids packed
    when the request asked for that form (``packed_replies``)."""
    if isinstance(data, dict) and not data.get("error"):  # Responses bodies carry "error": null
        answered = _answered_name.get() or served_model
        if answered is not None and "model" in data:
            data["model"] = answered
        if version is not None:
            data[semconv.RESPONSE_POLICY_VERSION] = version
        spans.observe_reply(data)  # the relay's own LLM span reads what the agent gets
        pack_reply_ids(data, stream_event)
    return data


def encode_json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def rewrite_sse_event(lines: list[str], served_model: str | None, version: int | None) -> bytes:
    """One server-sent event (its lines, without the blank line that ends it), rewritten like a
    JSON reply when its data is a JSON object; ``[DONE]``, comments and other fields unchanged."""
    data_lines = [line for line in lines if line.startswith(SSE_DATA_PREFIX)]
    if not data_lines:
        return ("\n".join(lines) + "\n\n").encode()
    payload = "\n".join(line[len(SSE_DATA_PREFIX):].removeprefix(" ") for line in data_lines)
    other = [line for line in lines if not line.startswith(SSE_DATA_PREFIX)]
    if payload.strip() != SSE_DONE_PAYLOAD:
        try:
            data = json.loads(payload)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            # a Responses stream event carries its response object, Anthropic's message_start its message
            response = data.get("response") if "response" in data else data.get("message")
            answered = _answered_name.get() or served_model
            if answered is not None and isinstance(response, dict) and "model" in response:
                response["model"] = answered
            payload = json.dumps(rewrite_reply(data, served_model, version, stream_event=True), separators=(",", ":"))
    return "".join(f"{line}\n" for line in [*other, f"data: {payload}"]).encode() + b"\n"


def error_body(message: str, error_type: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body, ``{"type": "error", "error": {type, message}}`` (the ``/v1/messages`` route's)."""
    kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
    return {"type": "error", "error": {"type": kinds.get(status, "api_error"), "message": message}}


def sse_error_event(body: dict[str, Any]) -> bytes:
    """An error sent in place of the rest of a stream (the ``openai`` client raises it; Anthropic's
    body goes as an ``error`` event, which the ``anthropic`` client raises)."""
    event = "event: error\n" if body.get("type") == "error" else ""
    return f"{event}data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


__all__ = ["CHAT_PATH", "COMPLETIONS_PATH", "GENERATION_PATHS", "MESSAGES_PATH", "RESPONSES_PATH", "VLLM_ONLY_FIELDS",
           "anthropic_error_body", "answer_as",
           "constrains_output", "encode_json", "error_body", "rewrite_reply", "rewrite_request", "rewrite_sse_event",
           "sse_error_event"]
