"""An agent whose reward depends on its instructions alone: it asks the model to reply with a word.

It knows nothing of spanrl: the OpenAI SDK, its own system prompt (``SYSTEM_PROMPT``) and the
task's word. The reward (``reward.py``) wants the word in square brackets, which the agent's own
prompt does not ask for; a model warm-started on ``demonstrations.py`` follows the format the
instructions name. So the only way to raise the reward without training weights is to change
the instructions the model sees: what ``algorithm: apo`` does at the policy endpoint, with the
agent unchanged (docs/apo.md). Run by ``spanrl run`` as ``spanrl.examples.reply_format.agent:reply``.
"""

from __future__ import annotations

import os

from openai import OpenAI

SYSTEM_PROMPT = "Reply to the user."
MAX_TOKENS = 8

_client: OpenAI | None = None


def reply(task: dict) -> str:
    """The model's reply to the task's word (the runner records it as the variable ``output``)."""
    global _client
    if _client is None:
        _client = OpenAI(max_retries=0, timeout=60.0)
    answer = _client.chat.completions.create(
        model=os.environ.get("OPENAI_MODEL", "policy"),
        messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["word"]}],
        max_tokens=MAX_TOKENS, temperature=1.0)
    return (answer.choices[0].message.content or "").strip()
