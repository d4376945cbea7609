"""Structured outputs: what a request asks its reply to be, as a grammar the engine enforces.

Torch-free (the HTTP front end runs it). Called by ``chat_completions.py`` (``response_format``,
strict tools, forced ``tool_choice``) and ``responses.py`` (``text.format``, the same for tools).
``AnswerFormat`` is what the reply's text must be (free text, any JSON object, or JSON of a
schema); ``reply_grammar`` joins it with the request's ``ToolSetup`` into one llguidance grammar
(Lark with embedded ``%json`` schemas), or None when nothing constrains the reply, so that free
requests cost the engine nothing. The engine masks each step's logits with it
(``engine/grammar.py``), as vLLM does with its guided-decoding backends (xgrammar, llguidance).

What is constrained:
- ``json_object`` / ``json_schema`` (``strict`` or not, as vLLM: the schema is always enforced):
  the reply is one JSON value of the schema, written as Python's ``json.dumps`` writes it
  (``", "`` and ``": "``, no other whitespace: a weak model cannot wander off in blanks);
- ``tool_choice`` naming a function, or ``required``: the server writes the opening of the call
  into the prompt (``tool_calls.forced_prefix``); the grammar continues it with arguments of the
  tool's ``parameters`` schema and the call's close (more calls after it for ``required`` when
  ``parallel_tool_calls`` allows);
- ``tool_choice: auto`` with strict tools (chat: ``function.strict``; Responses: ``strict``,
  true unless false, as in OpenAI's Responses API): free text, and each ``<tool_call>`` the model
  opens must name an offered tool and carry arguments of its schema (any JSON object for a
  non-strict tool). With a JSON answer format, the reply is either that JSON or tool calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from spanrl.trainer_bridge.torch_backend.server.tool_calls import CALL_CLOSE, CALL_OPEN, ToolSetup, tool_name

# how the engine's JSON is written (llguidance's JSON compile options)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT: dict[str, Any] = {"type": "object"}
CALL_HEAD = CALL_OPEN + '\n{"name": "'  # an opened call up to its name
CALL_TAIL = "}\n" + CALL_CLOSE  # after the arguments: the call object's brace and the close tag


class StructuredOutputError(ValueError):
    """A format or schema the server cannot enforce; ``param`` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class AnswerFormat:
    """What the reply's text must be: ``text`` (anything), ``json_object`` or ``json_schema``."""

    kind: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool | None = None
    param: str = "response_format"  # the request field it came from (named in errors)

    @property
    def is_json(self) -> bool:
        return self.kind != "text"

    @property
    def json_schema(self) -> dict[str, Any]:
        return self.schema if self.schema is not None else ANY_OBJECT


def chat_answer_format(response_format: Any) -> AnswerFormat:
    """Chat completions' ``response_format``: ``{"type": "text" | "json_object"}`` or ``{"type":
    "json_schema", "json_schema": {"name", "schema", "strict"}}``."""
    if response_format is None:
        return AnswerFormat()
    if not isinstance(response_format, dict):
        raise StructuredOutputError("response_format must be an object with a \"type\"", "response_format")
    kind = response_format.get("type")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise StructuredOutputError("response_format.json_schema must be an object {\"name\", \"schema\", "
                                        "\"strict\"}", "response_format.json_schema")
        return _schema_format(spec, "response_format.json_schema")
    return _simple_format(kind, "response_format.type")


def responses_answer_format(text: Any) -> AnswerFormat:
    """The Responses API's ``text``: ``{"format": {"type": "text" | "json_object"}}`` or ``{"format":
    {"type": "json_schema", "name", "schema", "strict"}}``."""
    if text is None:
        return AnswerFormat()
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        if isinstance(text, dict):
            return AnswerFormat()
        raise StructuredOutputError("text must be an object {\"format\": {...}}", "text")
    if not isinstance(fmt, dict):
        raise StructuredOutputError("text.format must be an object with a \"type\"", "text.format")
    if fmt.get("type") == "json_schema":
        return _schema_format(fmt, "text.format")
    return _simple_format(fmt.get("type"), "text.format.type")


def _simple_format(kind: Any, param: str) -> AnswerFormat:
    if kind == "text":
        return AnswerFormat()
    if kind == "json_object":
        return AnswerFormat("json_object", param=param.rsplit(".", 1)[0])
    raise StructuredOutputError(f"{param} must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}", param)


def _schema_format(spec: dict[str, Any], param: str) -> AnswerFormat:
    schema = spec.get("schema", ANY_OBJECT)
    if not isinstance(schema, dict):
        raise StructuredOutputError(f"{param}.schema must be a JSON schema object", f"{param}.schema")
    name = spec.get("name")
    strict = spec.get("strict")
    return AnswerFormat("json_schema", schema, name if isinstance(name, str) else None,
                        strict if isinstance(strict, bool) else None, param=f"{param}.schema")


def reply_grammar(answer: AnswerFormat, setup: ToolSetup) -> str | None:
    """The llguidance grammar (Lark) of the reply, or None when nothing constrains it.

    The grammar describes what the model samples: after ``setup.forced_prefix`` (written into
    the prompt) when ``tool_choice`` forces a call. Raises ``StructuredOutputError`` naming the
    request field whose schema llguidance cannot compile."""
    if setup.chosen is not None:  # a named function (or ``required`` with a single tool)
        tool = _tool_by_name(setup, setup.chosen)
        lark = f"start: {_quote(' ')} {_json(_parameters(tool))} {_quote(CALL_TAIL)}"
    elif setup.mode == "required":  # the prompt ends with '<tool_call>\n{"name": "'
        more = f' ({_quote(chr(10) + CALL_HEAD)} call_rest)*' if setup.parallel else ""
        lark = f"start: call_rest{more}\n{_call_rest_rule(setup, forced=True)}"
    elif setup.mode == "auto" and (answer.is_json or setup.strict):
        lark = _auto_grammar(answer, setup)
    elif answer.is_json:
        lark = f"start: {_json(answer.json_schema)}"
    else:
        return None
    _check(lark, answer, setup)
    return lark


def _auto_grammar(answer: AnswerFormat, setup: ToolSetup) -> str:
    """``tool_choice: auto``: the answer, or calls whose arguments follow their tool's schema."""
    rest = _call_rest_rule(setup, forced=False)
    if answer.is_json:  # either the JSON answer, or calls (OpenAI's typed output with tools)
        more = f' ({_quote(chr(10) + CALL_HEAD)} call_rest)*' if setup.parallel else ""
        return f"start: answer | {_quote(CALL_HEAD)} call_rest{more}\nanswer: {_json(answer.json_schema)}\n{rest}"
    # free text; a call opens when the text reaches <tool_call> (a lazy lexeme: it ends there)
    calls = "call*" if setup.parallel else "call?"
    return (f"start: {calls} TEXT\n"
            "TEXT: /(.|\\n)*/\n"
            f"call_open[lazy]: TEXT {_quote(CALL_OPEN)}\n"
            f"call: call_open {_quote(CALL_HEAD[len(CALL_OPEN):])} call_rest\n{rest}")


def _call_rest_rule(setup: ToolSetup, forced: bool) -> str:
    """``call_rest``: a call after its opening up to the name's first character: one alternative
    per tool, its name, its arguments and the close. Forced calls and strict tools follow the
    tool's schema; a non-strict tool in ``auto`` takes any JSON object (a call must be an object
    to be read as one)."""
    alternatives = []
    for tool in setup.tools:
        name = tool_name(tool)
        if name is None:
            continue
        schema = _parameters(tool) if forced or name in setup.strict else ANY_OBJECT
        head = name + '", "arguments": '
        alternatives.append(f"{_quote(head)} {_json(schema)} {_quote(CALL_TAIL)}")
    return "call_rest: " + " | ".join(alternatives)


def _tool_by_name(setup: ToolSetup, name: str) -> dict[str, Any]:
    return next(tool for tool in setup.tools if tool_name(tool) == name)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool.get("function", {}).get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else ANY_OBJECT


def _json(schema: dict[str, Any]) -> str:
    """A schema embedded in the Lark grammar, with spanrl's JSON style."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def _quote(text: str) -> str:
    """A Lark string literal of ``text``."""
    return json.dumps(text)


def _check(lark: str, answer: AnswerFormat, setup: ToolSetup) -> None:
    """Compile each schema, then the grammar, once here (no tokenizer needed), so a schema
    llguidance cannot enforce is a 400 naming its field, not a failure in the engine."""
    import llguidance

    checks = [(answer.param, answer.json_schema)] if answer.is_json else []
    for index, tool in enumerate(setup.tools):  # the schemas the grammar enforces, not those it does not
        name = tool_name(tool)
        forced = setup.chosen == name if setup.chosen is not None else setup.mode == "required"
        if forced or (setup.mode == "auto" and name in setup.strict):
            checks.append((f"tools[{index}]", _parameters(tool)))
    for param, schema in checks:
        error = llguidance.LLMatcher.validate_grammar(f"start: {_json(schema)}")
        if error:
            raise StructuredOutputError(f"{param}: this JSON schema cannot be enforced: {error}", param)
    error = llguidance.LLMatcher.validate_grammar(lark)
    if error:
        raise StructuredOutputError(f"the output constraint cannot be enforced: {error}",
                                    answer.param if answer.is_json else "tools")


__all__ = ["AnswerFormat", "StructuredOutputError", "chat_answer_format", "reply_grammar",
           "responses_answer_format"]
