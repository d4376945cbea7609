"""Opt-in re-tokenization of LLM calls that arrived without engine token ids.

Called by ``assembly.py`` only when the user names a tokenizer (``--retokenize-with DIR``).
Ids rebuilt from text may differ from what the engine sampled, so every such transition is
flagged ``retokenized``. Uses the ``tokenizers`` library and the tokenizer's own chat template
(rendered in jinja2's immutable sandbox, as transformers renders them), both imported lazily, so
the receiver never imports torch.

The text comes from OpenInference attributes: ``llm.input_messages.<i>.message.role/content``
and ``llm.output_messages.0.message.content``, else ``input.value`` / ``output.value``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from openinference.semconv.trace import MessageAttributes, SpanAttributes

from spanrl.instrumentation import semconv

# openinference's message keys: llm.input_messages.<i>.message.role / .content (and output)
_MESSAGE_KEY = re.compile(
    rf"^({re.escape(SpanAttributes.LLM_INPUT_MESSAGES)}|{re.escape(SpanAttributes.LLM_OUTPUT_MESSAGES)})"
    rf"\.(\d+)\.({re.escape(MessageAttributes.MESSAGE_ROLE)}|{re.escape(MessageAttributes.MESSAGE_CONTENT)})$"
)


class RetokenizeError(ValueError):
    """The tokenizer cannot be loaded, or a call has no text to re-tokenize."""


class Retokenizer:
    """A Hugging Face tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``)."""

    def __init__(self, name_or_path: str) -> None:
        self.name = name_or_path
        directory = Path(name_or_path)
        tokenizer_file = directory / "tokenizer.json" if directory.is_dir() else directory
        if not tokenizer_file.is_file():
            raise RetokenizeError(
                f"--retokenize-with {name_or_path!r}: expected a local tokenizer directory with"
                " tokenizer.json (the receiver never downloads models)"
            )
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config_file = tokenizer_file.parent / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self._chat_template = config.get("chat_template")
        self._special = {k: config.get(k) for k in ("bos_token", "eos_token")}

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def render_prompt(self, messages: list[dict[str, str]]) -> str:
        if not self._chat_template:
            return "".join(m["content"] for m in messages)
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise RetokenizeError(f"chat template error: {message}")

        # the template comes from a file the user named, but it renders text that agents wrote:
        # the sandbox keeps it from reaching Python internals or changing the messages it reads
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, **kw: json.dumps(value)
        try:
            template = env.from_string(self._chat_template)
            return template.render(messages=messages, add_generation_prompt=True, **self._special)
        except TemplateError as exc:  # a broken template, or one the sandbox stopped (SecurityError)
            raise RetokenizeError(f"chat template error: {type(exc).__name__}: {exc}") from exc

    def retokenize(self, attributes: dict[str, Any]) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids) of one LLM span from its text attributes."""
        inputs: dict[int, dict[str, str]] = {}
        outputs: dict[int, dict[str, str]] = {}
        for key, value in attributes.items():
            match = _MESSAGE_KEY.match(key)
            if match and isinstance(value, str):
                side = inputs if match.group(1) == SpanAttributes.LLM_INPUT_MESSAGES else outputs
                side.setdefault(int(match.group(2)), {})[match.group(3)] = value
        if inputs:
            role, content = MessageAttributes.MESSAGE_ROLE, MessageAttributes.MESSAGE_CONTENT
            messages = [
                {"role": m.get(role, "user"), "content": m.get(content, "")} for _, m in sorted(inputs.items())
            ]
            prompt_text = self.render_prompt(messages)
        elif isinstance(attributes.get(semconv.INPUT_VALUE), str):
            prompt_text = attributes[semconv.INPUT_VALUE]
        else:
            raise RetokenizeError("the span has no prompt text (llm.input_messages or input.value)")
        if outputs:
            response_text = outputs[min(outputs)].get(MessageAttributes.MESSAGE_CONTENT, "")
        elif isinstance(attributes.get(semconv.OUTPUT_VALUE), str):
            response_text = attributes[semconv.OUTPUT_VALUE]
        else:
            raise RetokenizeError("the span has no response text (llm.output_messages or output.value)")
        return self.encode(prompt_text), self.encode(response_text)
