"""Tool calls in the model's own words: the hermes form Qwen-family models write, parsed and steered.

Torch-free. Called by ``chat_completions.py`` and ``responses.py`` (through ``chat_format``):

- ``parse_tool_calls(text)``: a finished reply as ``content`` + ``tool_calls``. A call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (the last one may lack its
  closing tag when generation stopped there). As vLLM's hermes parser does, a reply any of whose
  calls is not such an object is returned whole as plain content, never an error.
- ``ToolCallStream``: the same while tokens arrive: text before a call streams as content, each
  call as a first delta with its id and name, then its arguments' text in fragments as sampled.
- ``forced_prefix(choice, tools)``: how ``tool_choice`` naming a function (or ``required``) is
  steered: the opening of a call the server writes after the generation prompt, as part of the
  prompt (see ``docs/policy.md``: the response ids stay exactly what the model sampled).

The arguments string of a call is the JSON text the model sampled, verbatim (vLLM re-serializes
it): rendered back into the next turn's prompt unchanged, the conversation's ids stay a prefix.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"

# the head of a call up to its arguments' value: the name is a JSON string without escapes
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]*)"\s*,\s*"arguments"\s*:\s*')
_DECODER = json.JSONDecoder()


class ToolChoiceError(ValueError):
    """``tool_choice`` names no offered function, or asks for a call with no tools given."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is the JSON text of its arguments, as sampled."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedReply:
    """A finished reply: its text outside the calls (None when there is none) and its calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def content_before_call(text: str) -> str:
    """The text the model wrote before its first call, without the one newline that separates them
    (the chat template writes it back between the content and the call)."""
    return text[:-1] if text.endswith("\n") else text


def _parse_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` of one call's body, None when it is not a call object."""
    head = _CALL_HEAD.match(body)
    if head is None:
        return None
    start = head.end()
    try:
        value, end = _DECODER.raw_decode(body, start)
    except ValueError:
        return None
    if not isinstance(value, dict) or body[end:].strip() != "}":
        return None
    return head.group("name"), body[start:end]


def parse_tool_calls(text: str) -> ParsedReply:
    """``text`` as content and tool calls (hermes form); malformed calls leave it all content."""
    first = text.find(CALL_OPEN)
    if first < 0:
        return ParsedReply(content=text)
    calls: list[ToolCall] = []
    position = first
    while position >= 0:
        body_start = position + len(CALL_OPEN)
        close = text.find(CALL_CLOSE, body_start)
        body = text[body_start:] if close < 0 else text[body_start:close]
        parsed = _parse_call(body)
        if parsed is None:
            return ParsedReply(content=text)
        calls.append(ToolCall(new_call_id(), *parsed))
        if close < 0:
            break
        position = text.find(CALL_OPEN, close + len(CALL_CLOSE))
    content = content_before_call(text[:first])
    return ParsedReply(content=content or None, tool_calls=tuple(calls))


# ----------------------------------------------------------------------------- tool_choice


@dataclass(frozen=True)
class ToolSetup:
    """What a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` mean for one call:
    the tools rendered into the prompt (none for ``tool_choice: none``), the text the server
    writes at the start of the reply (``forced_prefix``), whether replies are parsed for calls,
    and, for structured outputs (``structured_output.py``): the ``mode`` (``none``, ``auto``,
    ``required``), the function a call is forced to (``chosen``: a named ``tool_choice``, or
    ``required`` with one tool) and the names of the strict tools."""

    tools: tuple[dict[str, Any], ...] = ()
    forced_prefix: str = ""
    parallel: bool = True
    mode: str = "none"
    chosen: str | None = None
    strict: frozenset[str] = frozenset()

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools)


def tool_name(tool: dict[str, Any]) -> str | None:
    """The function name of a chat-completions tool (``{"type": "function", "function": {...}}``)."""
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def chosen_function(tool_choice: Any) -> str | None:
    """The function a ``tool_choice`` names (chat's ``{"type": "function", "function": {"name"}}``
    or the Responses API's ``{"type": "function", "name"}``), None for a mode string."""
    if not isinstance(tool_choice, dict):
        return None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
    if not isinstance(name, str) or not name:
        raise ToolChoiceError("tool_choice: name the function as {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}, or use \"auto\", \"none\" or \"required\"")
    return name


def tool_setup(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               strict: frozenset[str] | None = None) -> ToolSetup:
    """The ``ToolSetup`` of a request (``tools`` in the chat-completions form). ``strict``: the
    names of the strict tools (default: those whose ``function.strict`` is true)."""
    offered = tuple(tools or ())
    if tool_choice is None:
        tool_choice = "auto"
    if tool_choice == "none" or not offered:
        if tool_choice == "required" or isinstance(tool_choice, dict):
            raise ToolChoiceError("tool_choice asks for a tool call but the request offers no tools: add tools")
        return ToolSetup()
    names = [name for name in (tool_name(tool) for tool in offered) if name is not None]
    named = chosen_function(tool_choice)
    mode = "required"
    if named is not None:
        if named not in names:
            raise ToolChoiceError(f"tool_choice names {named!r}, which is not among the tools offered: "
                                  f"{', '.join(str(n) for n in names)}")
    elif tool_choice == "required":
        named = names[0] if len(names) == 1 else None
    elif tool_choice == "auto":
        mode = "auto"
    else:
        raise ToolChoiceError(f"tool_choice must be \"auto\", \"none\", \"required\" or a named function, "
                              f"got {tool_choice!r}")
    prefix = "" if mode == "auto" else forced_prefix(named) if named is not None else CALL_OPEN + '\n{"name": "'
    if strict is None:
        strict = frozenset(name for name, tool in zip(map(tool_name, offered), offered, strict=True)
                           if name is not None and (tool.get("function") or {}).get("strict") is True)
    return ToolSetup(tools=offered, forced_prefix=prefix, parallel=parallel_tool_calls is not False, mode=mode,
                     chosen=named, strict=strict)


def forced_prefix(name: str) -> str:
    """The opening of a call to ``name`` the server writes for the model, up to the colon after
    ``"arguments"``: it ends on a pre-token boundary of Qwen-style tokenizers, so the prompt's ids
    plus the sampled ``' {...}'`` are the ids of the whole rendered call."""
    return CALL_OPEN + "\n" + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments":'


def keep_calls(reply: ParsedReply, setup: ToolSetup) -> ParsedReply:
    """``parallel_tool_calls: false``: only the first call is returned."""
    if setup.parallel or len(reply.tool_calls) <= 1:
        return reply
    return ParsedReply(reply.content, reply.tool_calls[:1])


# ----------------------------------------------------------------------------- streaming


@dataclass(frozen=True)
class CallDelta:
    """A streamed piece of call ``index``: its id and name (first piece) or an arguments fragment."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class StreamPiece:
    """What one arrival of text adds: content text and/or call pieces."""

    content: str = ""
    calls: tuple[CallDelta, ...] = ()


class ToolCallStream:
    """Splits a streamed reply into content and call deltas as text arrives (``feed``), ``finish``
    at its end. Content before a call streams at once, except a trailing ``<`` that may open a
    call. Inside a call nothing is said until its head (``{"name": "...", "arguments":``) is read;
    then the id and name go out, then the arguments' text as sampled up to the end of their JSON
    value. A call whose head never forms is given back as content at the end (as the finished
    reply's parse would). ``parallel=False`` streams only the first call."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.text = ""        # all text so far
        self.sent = 0         # text before this offset is said (as content or inside a call)
        self.calls: list[ToolCall] = []
        self._args_start = -1  # offset of the current call's arguments value, -1 outside one
        self._args_sent = 0    # offset up to which its arguments went out
        self._args_end = -1    # offset just past its arguments value once complete
        self._scanner = _JsonValueEnd()
        self._held_content = ""   # text of an unformed call, given back if it never forms

    def feed(self, text: str) -> StreamPiece:
        self.text += text
        return self._advance(final=False)

    def finish(self) -> StreamPiece:
        piece = self._advance(final=True)
        if self._args_start >= 0:  # cut off inside a call: its arguments are what was sampled
            last = self.calls[-1]
            self.calls[-1] = ToolCall(last.id, last.name, self.text[self._args_start:self._args_sent])
        return piece

    def _advance(self, final: bool) -> StreamPiece:
        content: list[str] = []
        deltas: list[CallDelta] = []
        while True:
            if self._args_start >= 0:
                if not self._stream_arguments(deltas):
                    break
                continue
            opened = self.text.find(CALL_OPEN, self.sent)
            if opened < 0:
                end = len(self.text) if final else _safe_end(self.text, self.sent)
                if not self.calls:
                    content.append(self.text[self.sent:end])
                    self.sent = end
                break
            if not self.calls:
                before = self.text[self.sent:opened]
                content.append(content_before_call(before))
            if not self._open_call(opened, deltas, final):
                if final and not self.calls:
                    content.append(self.text[opened:])
                    self.sent = len(self.text)
                break
        return StreamPiece("".join(content), tuple(deltas))

    def _open_call(self, opened: int, deltas: list[CallDelta], final: bool) -> bool:
        head = _CALL_HEAD.match(self.text, opened + len(CALL_OPEN))
        if head is None or head.end() == len(self.text) or self.text[head.end()] != "{":
            self.sent = opened  # not complete yet, or not a call (arguments are an object): held
            return False
        if not self.parallel and self.calls:
            self.sent = len(self.text)
            return False
        call = ToolCall(new_call_id(), head.group("name"), "")
        self.calls.append(call)
        deltas.append(CallDelta(len(self.calls) - 1, id=call.id, name=call.name))
        self._args_start = self._args_sent = head.end()
        self._scanner = _JsonValueEnd()
        return True

    def _stream_arguments(self, deltas: list[CallDelta]) -> bool:
        """Send what arrived of the current call's arguments; True once the call is closed."""
        if self._args_end < 0:
            end = self._scanner.scan(self.text, self._args_sent)
            stop = len(self.text) if end < 0 else end
            if stop > self._args_sent:
                deltas.append(CallDelta(len(self.calls) - 1, arguments=self.text[self._args_sent:stop]))
                self._args_sent = stop
            if end < 0:
                return False
            self._args_end = end
        close = self.text.find(CALL_CLOSE, self._args_end)
        if close < 0:
            return False
        index = len(self.calls) - 1
        self.calls[index] = ToolCall(self.calls[index].id, self.calls[index].name,
                                     self.text[self._args_start:self._args_end])
        self.sent = close + len(CALL_CLOSE)
        self._args_start, self._args_end = -1, -1
        return True


def _safe_end(text: str, start: int) -> int:
    """How far ``text`` may stream as content: all but a tail that could begin ``<tool_call>``
    (or a newline just before one, which the finished reply's content drops)."""
    for keep in range(min(len(CALL_OPEN) + 1, len(text) - start), 0, -1):
        tail = text[len(text) - keep:]
        if CALL_OPEN.startswith(tail) or ("\n" + CALL_OPEN).startswith(tail):
            return len(text) - keep
    return len(text)


class _JsonValueEnd:
    """Finds where a JSON value ends as its text arrives: tracks strings, escapes and nesting."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False

    def scan(self, text: str, start: int) -> int:
        """The offset just past the value's end if it ends in ``text[start:]``, else -1."""
        for offset in range(start, len(text)):
            char = text[offset]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return offset + 1
                continue
            if not self.started and char.isspace():
                continue
            self.started = True
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return offset + 1
            elif self.depth == 0 and char in ",}\n":
                return offset
        return -1


__all__ = ["CALL_CLOSE", "CALL_OPEN", "CallDelta", "ParsedReply", "RESPONSE_CLOSE", "RESPONSE_OPEN", "StreamPiece",
           "ToolCall", "ToolCallStream", "ToolChoiceError", "ToolSetup", "chosen_function", "content_before_call",
           "forced_prefix", "keep_calls", "new_call_id", "parse_tool_calls", "tool_name", "tool_setup"]
