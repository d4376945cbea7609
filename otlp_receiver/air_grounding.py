"""AIR's grounding check: did an LLM call's tool arguments use numbers it was never given?

Used by ``air.py`` for rules with ``when: {ungrounded_numbers: true}``. A model that copies a
number wrongly into a tool call (``608-22`` where the question said 42) is a mistake the final
reward sees only as "wrong", and only at the end; this check sees it on the call that made it.
It reads the call's text as OpenInference span attributes (``call_text.py``): the numbers of its
tool-call arguments (``llm.output_messages.*...function.arguments``) against every number in its
input messages (the question, the tool results, earlier arguments). A span without input messages
cannot be judged and never matches; so instrument the agent's LLM client with a recorder of
message text (openinference's, as spanrl's instrumentation does by default).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from spanrl.otlp_receiver.call_text import CALL_ARGUMENTS, INPUT, OUTPUT

INPUT_PREFIX, OUTPUT_PREFIX, ARGUMENTS_SUFFIX = f"{INPUT}.", f"{OUTPUT}.", f".{CALL_ARGUMENTS}"
# a number not glued to a word or to another number's digits ("x2", "v1.2.3" are not numbers here)
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?!\w|\.\d)")


def numbers_in(text: str) -> set[float]:
    """The numbers written in ``text``, signless (``-53`` and ``53`` are one number here)."""
    return {float(match) for match in NUMBER.findall(text)}


def ungrounded_numbers(attributes: Mapping[str, Any]) -> list[str] | None:
    """The numbers of the call's tool arguments that none of its input messages holds, in order;
    ``None`` when the span holds no input message text (nothing to judge against)."""
    given: set[float] = set()
    has_input = False
    arguments: list[str] = []
    for key, value in attributes.items():
        if not isinstance(value, str):
            continue
        if key.startswith(INPUT_PREFIX):
            has_input = True
            given |= numbers_in(value)
        elif key.startswith(OUTPUT_PREFIX) and key.endswith(ARGUMENTS_SUFFIX):
            arguments.append(value)
    if not has_input:
        return None
    return [number for text in arguments for number in NUMBER.findall(text) if float(number) not in given]
