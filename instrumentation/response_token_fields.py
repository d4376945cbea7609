"""Where vLLM's responses keep token ids, logprobs and the policy version (docs/interfaces.md §1):
reading each field, checked, for ``llm_span_recorder``; and taking the id fields out of a body or
stream chunk once read, when spanrl asked for them (the agent then sees what it would without
spanrl)."""

from __future__ import annotations

from array import array
from typing import Any

from spanrl.instrumentation import semconv
from spanrl.instrumentation.packed_values import (
    TOKEN_ID_TYPECODE,
    extend_packed_token_ids,
    pack_token_ids,
    packed_token_ids_problem,
)

# vLLM's fields of a body or chunk: the prompt's ids (top level or per choice), a choice's ids
_PROMPT_IDS, _CHOICE_IDS = semconv.RESPONSE_PROMPT_TOKEN_IDS, semconv.RESPONSE_CHOICE_TOKEN_IDS


class MalformedTokenData(ValueError):
    """A token-id or logprob field of a response is present but not the documented shape."""


def extend_token_ids(ids: array, value: Any) -> str | None:
    """Append the list ``value`` to ``ids`` (checked in C as it is copied), or the ids a packed
    string holds (spanrl's server, asked for that form); what is wrong with it, or None.

    A JSON ``true`` / ``false`` passes as 1 / 0: no server sends one, and ruling it out would
    cost a second pass over every id."""
    if type(value) is str:
        return extend_packed_token_ids(ids, value)
    if type(value) is not list and not isinstance(value, (list, tuple)):
        return f"should be a list of ints or packed ids, got {type(value).__name__}"
    try:
        ids.extend(value)
    except (TypeError, OverflowError) as exc:
        return f"should hold only ints from 0 to 2**32-1 ({exc})"
    return None


def token_ids_attribute_value(value: Any) -> str:
    """The attribute value of one whole id field: a packed string as it came (checked), a list
    packed; MalformedTokenData saying what is wrong (its caller adds where)."""
    if type(value) is str:
        problem = packed_token_ids_problem(value)
        if problem is None:
            return value
    else:
        ids = array(TOKEN_ID_TYPECODE)
        problem = extend_token_ids(ids, value)
        if problem is None:
            return pack_token_ids(ids)
    raise MalformedTokenData(problem)


def parse_policy_version(value: Any) -> int | None:
    """An int policy version from a body field or header value, or None when unusable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def choice_logprobs(choice: dict[str, Any]) -> tuple[float, ...] | None:
    """The sampled tokens' logprobs of one choice (chat or completions shape), or None."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return None
    content = logprobs.get("content")
    if isinstance(content, list):  # chat shape
        values = [entry.get("logprob") if isinstance(entry, dict) else None for entry in content]
    elif isinstance(logprobs.get("token_logprobs"), list):  # completions shape
        values = list(logprobs["token_logprobs"])
    else:
        return None
    result = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MalformedTokenData(f"logprobs should be numbers, found {value!r}")
        result.append(float(value))
    return tuple(result)


def message_tokens(messages: Any, where: str) -> array | None:
    """The ids of vLLM's ``input_messages`` / ``output_messages`` concatenated, None when absent."""
    if messages is None:
        return None
    if not isinstance(messages, list):
        raise MalformedTokenData(f"{where} should be a list, got {type(messages).__name__}")
    ids = array(TOKEN_ID_TYPECODE)
    for index, message in enumerate(messages):
        tokens = message.get(semconv.RESPONSE_MESSAGE_TOKENS) if isinstance(message, dict) else None
        problem = extend_token_ids(ids, tokens)
        if problem is not None:
            raise MalformedTokenData(f"{where}[{index}].{semconv.RESPONSE_MESSAGE_TOKENS} {problem}")
    return ids


def response_logprobs(response: dict[str, Any]) -> tuple[float, ...] | None:
    """The sampled tokens' logprobs of a Responses API response's ``output_text`` parts, or None."""
    values: list[float] = []
    found = False
    for item in response.get("output") or ():
        if not isinstance(item, dict) or item.get("type") != "message":
            continue
        for part in item.get("content") or ():
            if isinstance(part, dict) and part.get("type") == "output_text" and isinstance(part.get("logprobs"), list):
                found = True
                for entry in part["logprobs"]:
                    value = entry.get("logprob") if isinstance(entry, dict) else None
                    if isinstance(value, bool) or not isinstance(value, (int, float)):
                        raise MalformedTokenData(f"logprobs should be numbers, found {value!r}")
                    values.append(float(value))
    return tuple(values) if found else None


def remove_token_id_fields(data: dict[str, Any]) -> None:
    """Take the engine's token-id fields (the ones spanrl's request flag adds, module docstring) out
    of a parsed body or stream chunk, in place; everything else stays."""
    if isinstance(data.get("event"), str) and isinstance(data.get("data"), dict):
        data = data["data"]  # the SDK's {"event", "data"} form of a server-sent event
    data.pop(_PROMPT_IDS, None)
    data.pop(_CHOICE_IDS, None)  # Anthropic's message_delta
    choices = data.get("choices")
    if type(choices) is list:
        for choice in choices:
            if type(choice) is dict:
                choice.pop(_CHOICE_IDS, None)
                choice.pop(_PROMPT_IDS, None)  # completions
    for nested in (data, data.get("response"), data.get("message")):  # a response, its event, a message_start
        if type(nested) is dict:
            nested.pop(semconv.RESPONSE_INPUT_MESSAGES, None)
            nested.pop(semconv.RESPONSE_OUTPUT_MESSAGES, None)
            if nested is not data:
                nested.pop(_PROMPT_IDS, None)
                nested.pop(_CHOICE_IDS, None)
