"""A relay's replies with their token ids packed, when the agent's request asked for that form.

spanrl's instrumentation sends ``"spanrl_token_ids": "packed"`` with the id flag it adds (or a
client the header ``x-spanrl-token-ids: packed``); spanrl's own server then answers each id list
as one packed string (``torch_backend/server/token_id_form.py``, docs/interfaces.md §1). A relay
(the verl gateway, ``spanrl proxy``) gets lists from its upstream (vLLM), never sends the field
upstream (``rewrite.rewrite_request``), and packs the lists on the way out for such a request, so
an agent behind the gateway parses one string per list too. The rule is the server's: every list
of a body or of a stream's first or last event is packed, a stream's per-token ids stay lists (one
id parses for less than a string decodes). A field that is not a list of ids is left as it came:
the agent's reader names the problem.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from spanrl.instrumentation import semconv
from spanrl.instrumentation.packed_values import asks_packed_ids, pack_token_ids

# whether the current request asked for packed ids; its reply (each stream event too) reads it
_packed_asked: ContextVar[bool] = ContextVar("spanrl_relay_packed_ids", default=False)
_CHUNK_OBJECTS = frozenset({"chat.completion.chunk", "text_completion"})


def note_id_form(headers: Mapping[str, str], body: Mapping[str, Any]) -> None:
    """Remember for the current request whether its ``body`` or ``headers`` ask for packed ids;
    ValueError naming the body's field when its value is not a form."""
    _packed_asked.set(asks_packed_ids(headers, body))


def pack_reply_ids(data: dict[str, Any], stream_event: bool) -> None:
    """Pack the id lists of ``data`` (a reply body, or one stream event's data) in place, when the
    current request asked for packed ids."""
    if not _packed_asked.get():
        return
    _pack(data, semconv.RESPONSE_PROMPT_TOKEN_IDS)  # chat (body, first chunk), Anthropic's message
    _pack(data, semconv.RESPONSE_CHOICE_TOKEN_IDS)  # Anthropic's message and message_delta: every id
    choices = data.get("choices")
    if isinstance(choices, list):
        per_token = stream_event and data.get("object") in _CHUNK_OBJECTS
        for choice in choices:
            if isinstance(choice, dict):
                _pack(choice, semconv.RESPONSE_PROMPT_TOKEN_IDS)  # completions
                if not per_token:
                    _pack(choice, semconv.RESPONSE_CHOICE_TOKEN_IDS)
    for nested in (data, data.get("response"), data.get("message")):  # a response, its event, a message_start
        if not isinstance(nested, dict):
            continue
        if nested is not data:
            _pack(nested, semconv.RESPONSE_PROMPT_TOKEN_IDS)
            _pack(nested, semconv.RESPONSE_CHOICE_TOKEN_IDS)
        for field in (semconv.RESPONSE_INPUT_MESSAGES, semconv.RESPONSE_OUTPUT_MESSAGES):
            messages = nested.get(field)
            if isinstance(messages, list):
                for message in messages:
                    if isinstance(message, dict):
                        _pack(message, semconv.RESPONSE_MESSAGE_TOKENS)


def _pack(holder: dict[str, Any], key: str) -> None:
    value = holder.get(key)
    if type(value) is list:
        try:
            holder[key] = pack_token_ids(value)
        except (TypeError, OverflowError):  # not ids: sent as they came
            pass
