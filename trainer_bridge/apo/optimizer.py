"""The optimizer model: a critique of a prompt from its worst rollouts, then an edited prompt.

APO's "textual gradient" (ProTeGi; agent-lightning's APO): the optimizer model reads the
instructions and the text of the rollouts that scored lowest with them (``rollout_text.py``),
says what went wrong (the critique call), then rewrites the instructions with that critique in
hand (the edit call), between ``<prompt>`` and ``</prompt>``. Any OpenAI-compatible endpoint
serves (a hosted API, vLLM, Ollama, ``spanrl serve``) through the real ``openai`` client; its API
key is read from the environment variable the ``apo:`` block names and never logged.

An answer that cannot be used (the call failed, no ``<prompt>`` block, an empty or too long
prompt, the same prompt again) raises ``UnusableAnswer`` with the reason; ``apo/run.py`` drops
that candidate and logs the reason. Called by ``apo/run.py``; torch-free.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from .config import ApoConfig

logger = logging.getLogger(__name__)

CRITIQUE_PROMPT = """You improve the instructions (the system prompt) that an AI agent's language model is given.

The model was given these instructions:
<instructions>
{prompt}
</instructions>

Here are runs of the agent with them that scored low (the reward says how well a run did; higher is better):
{rollouts}

Say briefly what in the instructions led to these results and what the instructions should say \
instead. Do not write the new instructions yet."""

EDIT_PROMPT = """You improve the instructions (the system prompt) that an AI agent's language model is given.

The current instructions:
<instructions>
{prompt}
</instructions>

A critique of them, from runs that scored low:
<critique>
{critique}
</critique>

Write improved instructions that fix what the critique found and keep what works. Reply with the \
new instructions only, between <prompt> and </prompt>."""

_PROMPT_BLOCK = re.compile(r"<prompt>(.*?)</prompt>", re.DOTALL | re.IGNORECASE)


class UnusableAnswer(Exception):
    """The optimizer gave nothing usable for one candidate; the message says why."""


class PromptOptimizer:
    """Critique-then-edit calls to the optimizer model of an ``apo:`` block."""

    def __init__(self, config: ApoConfig, environ: dict[str, str] | None = None) -> None:
        from openai import OpenAI

        environ = dict(os.environ) if environ is None else environ
        key = environ.get(config.optimizer_key_env, "")
        if not key:
            logger.info("apo: %s is not set; calling the optimizer at %s without an API key",
                        config.optimizer_key_env, config.optimizer_url)
        self.config = config
        self.client = OpenAI(base_url=config.optimizer_url, api_key=key or "none", max_retries=1,
                             timeout=config.optimizer_timeout_s)

    def edit(self, prompt: str, rollouts: Sequence[str]) -> str:
        """An edited ``prompt`` written from the text of its low-scoring ``rollouts``; raises
        ``UnusableAnswer`` when the optimizer's answers cannot be used."""
        critique = self._ask(CRITIQUE_PROMPT.format(prompt=prompt, rollouts=_numbered(rollouts)), "critique")
        if not critique.strip():
            raise UnusableAnswer("the critique was empty")
        answer = self._ask(EDIT_PROMPT.format(prompt=prompt, critique=critique.strip()), "edit")
        return edited_prompt(answer, prompt, self.config.max_prompt_chars)

    def _ask(self, text: str, what: str) -> str:
        import openai

        try:
            reply: Any = self.client.chat.completions.create(
                model=self.config.optimizer_model, messages=[{"role": "user", "content": text}],
                temperature=self.config.optimizer_temperature, max_tokens=self.config.optimizer_max_tokens)
        except openai.APIStatusError as exc:
            raise UnusableAnswer(f"the {what} call failed: HTTP {exc.status_code} from the optimizer endpoint "
                                 f"{self.config.optimizer_url}") from None
        except openai.APIError as exc:  # connection errors, timeouts
            raise UnusableAnswer(f"the {what} call failed: {type(exc).__name__} at the optimizer endpoint "
                                 f"{self.config.optimizer_url}") from None
        choice: Any = reply.choices[0] if reply.choices else None
        content = choice.message.content if choice is not None else None
        if not content:
            raise UnusableAnswer(f"the {what} answer was empty")
        if what == "edit" and choice.finish_reason == "length" and "</prompt>" not in content.lower():
            raise UnusableAnswer(f"the edit answer was cut at {self.config.optimizer_max_tokens} tokens "
                                 "(apo.optimizer_max_tokens) before </prompt>")
        return str(content)


def edited_prompt(answer: str, previous: str, max_chars: int) -> str:
    """The new prompt in the edit ``answer``; ``UnusableAnswer`` when it has none that can be used."""
    found = _PROMPT_BLOCK.findall(answer)
    if not found:
        raise UnusableAnswer(f"no <prompt>...</prompt> block in the edit answer ({_excerpt(answer)})")
    text = found[-1].strip()  # the last block: a model may quote the format before answering
    if not text:
        raise UnusableAnswer("the edited prompt was empty")
    if len(text) > max_chars:
        raise UnusableAnswer(f"the edited prompt has {len(text)} characters, over apo.max_prompt_chars "
                             f"({max_chars})")
    if text == previous.strip():
        raise UnusableAnswer("the edited prompt is the candidate it edits, unchanged")
    return text


def _numbered(rollouts: Sequence[str]) -> str:
    return "\n\n".join(f"<run {n}>\n{text}\n</run {n}>" for n, text in enumerate(rollouts, 1))


def _excerpt(text: str, limit: int = 80) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[:limit] + "...")
