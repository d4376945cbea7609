"""Turn what an OpenAI-compatible endpoint returned into spanrl attributes on one LLM span.

``openai_instrumentor`` creates one ``LLMSpanRecorder`` per chat-completions / completions /
responses call and feeds it the raw JSON the SDK parses: the whole body for a normal call, or
each server-sent-event chunk for a streaming one. Response shapes are vLLM's (docs/interfaces.md §1):

- chat: top-level ``prompt_token_ids``, ``choices[i].token_ids``, logprobs in
  ``choices[i].logprobs.content[j].logprob``;
- completions: ``choices[i].prompt_token_ids``, ``choices[i].token_ids``, logprobs in
  ``choices[i].logprobs.token_logprobs``;
- responses (``"object": "response"``, or a stream's ``response.completed`` /
  ``response.incomplete`` / ``response.failed`` event carrying one): the prompt's ids in
  ``input_messages[].tokens``, the reply's in ``output_messages[].tokens`` (concatenated), logprobs
  in ``output[].content[].logprobs[].logprob`` of the ``output_text`` parts;
- Anthropic's messages (``"type": "message"``, spanrl's server with ``return_token_ids``): the
  prompt's ids in ``prompt_token_ids``, the reply's in ``token_ids`` (written as choice 0);
  streamed, on ``message_start``'s message and on ``message_delta``;
- all: top-level ``policy_version`` (or the ``x-spanrl-policy-version`` header) and ``id``.

A whole body as spanrl's server answers (one choice, packed ids, an int policy version) is read by
a short path with the same result, the common stream chunk by another. Ids and logprobs go on
the span packed (``packed_values``: one base64 string each). Streams
concatenate ``token_ids`` (and logprobs) per choice index; a choice's attributes are
written when its ``finish_reason`` arrives (and again if more ids follow), so the cost stays
linear in the number of tokens. Reading each field, checked, and taking the id fields out once
read (``removes_id_fields``: spanrl asked for them) is ``response_token_fields``'s.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from spanrl.instrumentation import semconv
from spanrl.instrumentation.endpoints import PACKING_ENDPOINTS
from spanrl.instrumentation.packed_values import (
    TOKEN_ID_TYPECODE,
    extend_packed_token_ids,
    pack_logprobs,
    pack_token_ids,
    packed_token_ids_problem,
)
from spanrl.instrumentation.response_token_fields import (
    _CHOICE_IDS,
    _PROMPT_IDS,
    MalformedTokenData,
    choice_logprobs,
    extend_token_ids,
    message_tokens,
    parse_policy_version,
    remove_token_id_fields,
    response_logprobs,
    token_ids_attribute_value,
)

logger = logging.getLogger(__name__)


# ``object`` of the bodies and chunks that carry ``choices`` (the common case, checked first)
_CHOICE_OBJECTS = frozenset({"chat.completion", "chat.completion.chunk", "text_completion"})
# Stream events of the Responses API whose ``response`` is the finished response object.
_FINAL_RESPONSE_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
# Anthropic's Messages API: a message, and the stream events that carry its ids (the others,
# content blocks and pings, repeat nothing the recorder needs)
_MESSAGE_TYPES = frozenset({"message", "message_start", "message_delta"})
_OTHER_MESSAGE_EVENTS = frozenset({"content_block_start", "content_block_delta", "content_block_stop",
                                   "message_stop", "ping", "error"})


@dataclass
class _ChoiceTokens:
    token_ids: array = field(default_factory=lambda: array(TOKEN_ID_TYPECODE))
    logprobs: list[float] = field(default_factory=list)
    has_token_ids: bool = False
    has_logprobs: bool = False
    finished: bool = False
    # A malformed piece makes the whole sequence untrustworthy: never write it.
    broken_token_ids: bool = False
    broken_logprobs: bool = False


class LLMSpanRecorder:
    """Collects one LLM call's token ids, logprobs, policy version and response id onto its span.

    Never raises: a response with missing ids leaves the attributes out, a malformed one is
    logged (once per call) and the call goes on.
    """

    # What a new recorder starts with (one per LLM call: class defaults, not one store each per call)
    _warned = False
    _response_id_written = False
    _policy_version_written = False
    _prompt_ids_written = False
    _common_written = False  # response id and policy version: nothing more to look for
    # True when spanrl asked the endpoint for the ids: once read, they are taken out of the
    # body or chunk, so the agent's response object and openinference's ``output.value`` are
    # what they would be without spanrl (and the ids are not carried twice, as JSON text too)
    removes_id_fields = False
    # The key of the call's endpoint when spanrl does not know yet that it is spanrl's server or a
    # relay: an answer with a ``policy_version`` in its body says so (endpoints.py), and later calls
    # ask it for packed ids.
    packing_endpoint: str | None = None

    def __init__(self, span: Span, streaming: bool, header_policy_version: Any = None,
                 headers: Mapping[str, str] | None = None) -> None:
        """``header_policy_version``, or the ``x-spanrl-policy-version`` entry of the response's
        ``headers`` (read only when the body has no ``policy_version``), is the fallback version."""
        # Our keys are not openinference's, so its masking proxy (which would handle them
        # one by one) is passed by: one SDK set_attributes call per flush.
        self._target = getattr(span, "__wrapped__", span)
        self.streaming = streaming  # a stream's chunks, not one body
        self._choices: dict[int, _ChoiceTokens] = {}  # a stream's choices so far
        self._pending: dict[str, Any] = {}
        self._header_policy_version = header_policy_version
        self._headers = headers

    def observe(self, data: Any, headers: Mapping[str, str] | None = None) -> None:
        """Read one parsed JSON object: the whole body, or one stream chunk; ``headers``, the
        response's, unless the recorder was given them when made."""
        # The common cases first, in few steps: a whole body as spanrl's server answers, and a
        # stream's chunk that only adds ids to a choice seen before (the general path costs ~2 us
        # more a chunk in an agent's process, on every chunk).
        if type(data) is dict:
            if not self.streaming:
                if self._record_whole_body(data):
                    return
            elif self._common_written and self._add_middle_chunk(data):
                return
        if self._headers is None:
            self._headers = headers
        self._observe_any(data)

    def _observe_any(self, data: Any) -> None:
        """Read a body or chunk by its shape; what it sets is flushed to the span at the end."""
        choices_shape = type(data) is dict and data.get("object") in _CHOICE_OBJECTS
        try:
            if choices_shape:
                self._observe_choices(data)  # chat and completions bodies and chunks: the common case
            elif isinstance(data, dict):  # parsed JSON: plain dicts and lists
                self._observe(data)
        except Exception as exc:  # noqa: BLE001 - instrumentation must never break the agent
            if not self._warned:
                self._warned = True
                logger.warning("spanrl: could not record token ids of an LLM call: %s", exc)
        finally:
            if self.removes_id_fields and not choices_shape and isinstance(data, dict):
                remove_token_id_fields(data)  # (the choices shape takes them out as it reads them)
            if self._pending:
                self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        self._set_on_span(pending)

    def _set_on_span(self, attributes: dict[str, Any]) -> None:
        try:
            if self._target.is_recording():
                self._target.set_attributes(attributes)
        except Exception as exc:  # noqa: BLE001
            logger.warning("spanrl: could not set token-id attributes: %s", exc)

    def _record_whole_body(self, data: dict[str, Any]) -> bool:
        """A whole chat or completions body as spanrl's server answers a request for packed ids
        (a response id, an int policy version, one choice, its ids and the prompt's packed strings,
        no logprobs): its attributes set at once, True. Any other body: nothing done, False, for
        the general path (which also names what is wrong)."""
        if self._common_written or self._prompt_ids_written:
            return False  # a second body (the SDK hook reads one): the general path keeps the first's
        choices = data.get("choices")
        response_id = data.get("id")
        version = data.get(_BODY_POLICY_VERSION)
        if type(choices) is not list or len(choices) != 1 or type(response_id) is not str or type(version) is not int:
            return False
        choice = choices[0]
        if type(choice) is not dict or choice.get("logprobs") is not None:
            return False
        index = choice.get("index", 0)
        holder = data if _PROMPT_IDS in data else choice  # chat: on the body; completions: on the choice
        prompt_ids, reply_ids = holder.get(_PROMPT_IDS), choice.get(_CHOICE_IDS)
        if (type(index) is not int or index != 0 or (holder is data and _PROMPT_IDS in choice)
                or type(prompt_ids) is not str or type(reply_ids) is not str
                or packed_token_ids_problem(prompt_ids) is not None or packed_token_ids_problem(reply_ids) is not None):
            return False
        if self.removes_id_fields:
            del holder[_PROMPT_IDS], choice[_CHOICE_IDS]
        if self.packing_endpoint is not None:
            PACKING_ENDPOINTS.add(self.packing_endpoint)
        self._common_written = self._prompt_ids_written = True
        self._set_on_span({_RESPONSE_ID: response_id, _POLICY_VERSION: version,
                           _PROMPT_TOKEN_IDS: prompt_ids, _CHOICE_0_TOKEN_IDS: reply_ids})
        return True

    def _add_middle_chunk(self, data: dict[str, Any]) -> bool:
        """A stream chunk that only adds ids to one choice seen before (no prompt ids, no logprobs,
        not its last chunk): its ids added, True; anything else: False, for the general path.
        A dict with ``choices`` is a chat or completions chunk (the general path reads it so too)."""
        choices = data.get("choices")
        if type(choices) is not list or len(choices) != 1 or _PROMPT_IDS in data:
            return False
        choice = choices[0]
        if (type(choice) is not dict or choice.get("finish_reason") is not None
                or choice.get("logprobs") is not None or _PROMPT_IDS in choice):
            return False
        tokens = self._choices.get(choice.get("index", 0))
        raw_ids = choice.get(_CHOICE_IDS)
        if tokens is None or tokens.finished or tokens.broken_token_ids:
            return False
        if type(raw_ids) is list:
            try:
                tokens.token_ids.extend(raw_ids)  # checked in C as copied, as extend_token_ids does
            except (TypeError, OverflowError):
                return False  # the general path sees the same error (the ids are then never written)
        elif type(raw_ids) is not str or extend_packed_token_ids(tokens.token_ids, raw_ids) is not None:
            return False  # (a bad packed string appends nothing)
        tokens.has_token_ids = True
        if self.removes_id_fields:
            del choice[_CHOICE_IDS]
        return True

    def _observe(self, data: dict[str, Any]) -> None:
        if isinstance(data.get("event"), str) and isinstance(data.get("data"), dict):
            data = data["data"]  # the SDK's {"event", "data"} form of a server-sent event
        event_type = data.get("type")
        if isinstance(event_type, str) and event_type.startswith("response."):
            if event_type in _FINAL_RESPONSE_EVENTS and isinstance(data.get("response"), dict):
                self._observe_response(data["response"])
            return  # the other events repeat what the final response carries
        if data.get("object") == "response":
            self._observe_response(data)
            return
        if event_type in _MESSAGE_TYPES:
            self._observe_message(data)
            return
        if event_type in _OTHER_MESSAGE_EVENTS:
            return
        self._observe_choices(data)

    def _observe_choices(self, data: dict[str, Any]) -> None:
        """A chat or completions body, or one chunk of its stream."""
        if not self._common_written:
            self._observe_common(data)
        problem: MalformedTokenData | None = None  # the first one is raised once all was read
        take = dict.pop if self.removes_id_fields else dict.get  # read, and taken out when spanrl asked
        prompt_ids = take(data, semconv.RESPONSE_PROMPT_TOKEN_IDS, None)
        if prompt_ids is not None:
            try:
                self._set_prompt_ids(prompt_ids)
            except MalformedTokenData as exc:
                problem = MalformedTokenData(f"{semconv.RESPONSE_PROMPT_TOKEN_IDS} {exc}")
        choices = data.get("choices")
        if type(choices) is list:
            observe_choice = self._observe_choice if self.streaming else self._observe_body_choice
            # every choice is read even when another one is malformed: skipping a stream
            # chunk would silently shorten that choice's concatenated ids
            for position, choice in enumerate(choices):
                if isinstance(choice, dict):
                    try:
                        observe_choice(position, choice, take)
                    except MalformedTokenData as exc:
                        problem = problem or exc
        if problem is not None:
            raise problem

    def _observe_common(self, data: dict[str, Any]) -> None:
        """The response id and the policy version, from any body."""
        response_id = data.get("id")
        if type(response_id) is str and not self._response_id_written:  # parsed JSON: a plain str
            self._response_id_written = True
            self._pending[semconv.GENAI_RESPONSE_ID] = response_id
        if not self._policy_version_written:
            # the body's value wins over the header's, which is the fallback
            version = data.get(semconv.RESPONSE_POLICY_VERSION)
            if type(version) is not int:  # (spanrl's server sends an int: no more checks)
                version = parse_policy_version(version)
                if version is None:
                    version = self._fallback_policy_version()
            elif self.packing_endpoint is not None:
                PACKING_ENDPOINTS.add(self.packing_endpoint)  # an answer of spanrl's server or a relay
            if version is not None:
                self._policy_version_written = True
                self._pending[semconv.LLM_POLICY_VERSION] = version
        self._common_written = self._policy_version_written and self._response_id_written

    def _fallback_policy_version(self) -> int | None:
        value = self._header_policy_version
        if value is None and self._headers is not None:
            value = self._headers.get(semconv.POLICY_VERSION_HEADER)
        return parse_policy_version(value)

    def _observe_response(self, response: dict[str, Any]) -> None:
        """A whole Responses API response object: one reply, written as choice 0."""
        self._observe_common(response)
        prompt_ids = message_tokens(response.get(semconv.RESPONSE_INPUT_MESSAGES), semconv.RESPONSE_INPUT_MESSAGES)
        if prompt_ids is not None:
            self._set_token_ids(semconv.LLM_PROMPT_TOKEN_IDS, prompt_ids)
            self._prompt_ids_written = True
        output_ids = message_tokens(response.get(semconv.RESPONSE_OUTPUT_MESSAGES),
                                     semconv.RESPONSE_OUTPUT_MESSAGES)
        if output_ids is None:
            return
        self._set_token_ids(semconv.llm_response_token_ids(0), output_ids)
        logprobs = response_logprobs(response)
        if logprobs is not None and len(logprobs) == len(output_ids):
            self._set_logprobs(semconv.llm_response_logprobs(0), logprobs)

    def _observe_message(self, data: dict[str, Any]) -> None:
        """An Anthropic message, or its stream's ``message_start`` / ``message_delta`` event."""
        message = data.get("message") if data.get("type") == "message_start" else data
        if not isinstance(message, dict):
            return
        self._observe_common(message)
        prompt_ids = message.get(semconv.RESPONSE_PROMPT_TOKEN_IDS)
        if prompt_ids is not None:
            try:
                self._set_prompt_ids(prompt_ids)
            except MalformedTokenData as exc:
                raise MalformedTokenData(f"{semconv.RESPONSE_PROMPT_TOKEN_IDS} {exc}") from None
        ids = data.get(semconv.RESPONSE_CHOICE_TOKEN_IDS)
        if ids is not None:
            try:
                self._pending[_response_token_ids_key(0)] = token_ids_attribute_value(ids)
            except MalformedTokenData as exc:
                raise MalformedTokenData(f"{semconv.RESPONSE_CHOICE_TOKEN_IDS} {exc}") from None

    def _choice_index_and_prompt(self, position: int, choice: dict[str, Any],
                                 take: Callable[..., Any]) -> tuple[int, MalformedTokenData | None]:
        """A choice's index (MalformedTokenData when it is not one), and what is wrong with the
        prompt ids it carries (completions), or None; those ids are written unless they were."""
        index = choice.get("index", position)
        if type(index) is not int or index < 0:
            raise MalformedTokenData(f"choice index should be a non-negative int, got {index!r}")
        prompt_ids = take(choice, semconv.RESPONSE_PROMPT_TOKEN_IDS, None)
        if prompt_ids is not None:
            try:
                self._set_prompt_ids(prompt_ids)
            except MalformedTokenData as exc:
                return index, MalformedTokenData(f"choices[{index}].{semconv.RESPONSE_PROMPT_TOKEN_IDS} {exc}")
        return index, None

    def _observe_body_choice(self, position: int, choice: dict[str, Any], take: Callable[..., Any]) -> None:
        """One choice of a whole body: its ids and logprobs written at once, each unless malformed
        (a packed string as it came); ``take`` reads its id fields (``dict.pop``: and takes them out)."""
        index, problem = self._choice_index_and_prompt(position, choice, take)
        raw_ids = take(choice, semconv.RESPONSE_CHOICE_TOKEN_IDS, None)
        if raw_ids is not None:
            try:
                self._pending[_response_token_ids_key(index)] = token_ids_attribute_value(raw_ids)
            except MalformedTokenData as exc:
                problem = MalformedTokenData(f"choices[{index}].{semconv.RESPONSE_CHOICE_TOKEN_IDS} {exc}")
        if choice.get("logprobs") is not None:
            try:
                logprobs = choice_logprobs(choice)
                if logprobs is not None:
                    self._set_logprobs(semconv.llm_response_logprobs(index), logprobs)
            except MalformedTokenData as exc:
                problem = exc
        if problem is not None:
            raise problem

    def _observe_choice(self, position: int, choice: dict[str, Any], take: Callable[..., Any]) -> None:
        """One choice of a stream's chunk, its ids and logprobs added to the choice's; ``take``
        reads its id fields (``dict.pop``: and takes them out)."""
        index, problem = self._choice_index_and_prompt(position, choice, take)
        tokens = self._choices.get(index)
        if tokens is None:
            tokens = self._choices[index] = _ChoiceTokens()
        got_new = False
        raw_ids = take(choice, semconv.RESPONSE_CHOICE_TOKEN_IDS, None)
        if raw_ids is not None:
            wrong = extend_token_ids(tokens.token_ids, raw_ids)
            if wrong is None:
                tokens.has_token_ids = got_new = True
            else:
                tokens.broken_token_ids = True
                problem = MalformedTokenData(f"choices[{index}].{semconv.RESPONSE_CHOICE_TOKEN_IDS} {wrong}")
        if choice.get("logprobs") is not None:
            try:
                logprobs = choice_logprobs(choice)
                if logprobs is not None:
                    tokens.logprobs.extend(logprobs)
                    tokens.has_logprobs = got_new = True
            except MalformedTokenData as exc:
                tokens.broken_logprobs, problem = True, exc
        finish_reason = choice.get("finish_reason")
        if finish_reason is not None:
            tokens.finished = True
        # written once the choice has finished (and again if more ids follow)
        if tokens.finished and (got_new or finish_reason is not None):
            self._write_choice(index, tokens)
        if problem is not None:
            raise problem

    def _set_prompt_ids(self, value: Any) -> None:
        """The prompt's ids, unless written already; MalformedTokenData saying what is wrong (its
        caller adds where: the message is built only then)."""
        if self._prompt_ids_written:
            return  # completions repeat the prompt on every choice; the first one wins
        self._pending[semconv.LLM_PROMPT_TOKEN_IDS] = token_ids_attribute_value(value)
        self._prompt_ids_written = True

    def _write_choice(self, index: int, tokens: _ChoiceTokens) -> None:
        if tokens.has_token_ids and not tokens.broken_token_ids:
            self._set_token_ids(semconv.llm_response_token_ids(index), tokens.token_ids)
        if tokens.has_logprobs and not tokens.broken_logprobs:
            self._set_logprobs(semconv.llm_response_logprobs(index), tokens.logprobs)

    # ids and logprobs go on the span packed (packed_values.py): one string each, not an array
    # the SDK would check, and its exporter encode, element by element
    def _set_token_ids(self, key: str, ids: array) -> None:
        self._pending[key] = pack_token_ids(ids)  # checked already, as they were copied into ``ids``

    def _set_logprobs(self, key: str, values: Sequence[float]) -> None:
        self._pending[key] = pack_logprobs(values)


_CHOICE_0_TOKEN_IDS = semconv.llm_response_token_ids(0)
# (module names for the whole-body path: one lookup each, not two)
_BODY_POLICY_VERSION = semconv.RESPONSE_POLICY_VERSION
_RESPONSE_ID, _POLICY_VERSION, _PROMPT_TOKEN_IDS = (semconv.GENAI_RESPONSE_ID, semconv.LLM_POLICY_VERSION,
                                                   semconv.LLM_PROMPT_TOKEN_IDS)


def _response_token_ids_key(index: int) -> str:
    return _CHOICE_0_TOKEN_IDS if index == 0 else semconv.llm_response_token_ids(index)
