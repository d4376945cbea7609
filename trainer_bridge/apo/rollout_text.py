"""The text of a rollout as the optimizer model reads it: the task, its reward, each call's prompt
and response (tool calls and tool results included, as the model saw and wrote them).

The calls come from the receiver's assembled rollout: their token ids decoded with the served
model's ``tokenizer.json`` (the ``tokenizers`` library; what the model saw, chat template and
tool markup included). A call whose prompt continues the previous call's prompt and response
shows only what is new, so a rollout of many calls stays short. Calls without token ids (a
hosted model behind ``spanrl proxy``) are read from their spans' text instead
(``otlp_receiver.text_calls``: the messages, tools' calls and the reply). The whole text is cut to
``apo.rollout_chars`` (its start and its end kept). Called by ``apo/run.py`` and, without the
reward (``body``), by the reward judge (``judge/group_judge.py``); torch-free.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from spanrl.schema.rollouts import AssembledRollout, Transition

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"


class RolloutText:
    """Writes rollouts as text; decodes token ids with the model directory's tokenizer, if it has one."""

    def __init__(self, model_dir: str, max_chars: int, store: Any = None) -> None:
        self.max_chars, self.store = max_chars, store  # store: the receiver's SpanStore (text-only calls)
        self.tokenizer: Any = None
        path = os.path.join(model_dir, TOKENIZER_FILE)
        if os.path.isfile(path):
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(path)
        else:
            logger.info("apo: no %s in %s; the optimizer reads the calls' text from their spans", TOKENIZER_FILE,
                        model_dir)

    def text(self, task: Any, reward: float | None, rollout: AssembledRollout | None, status: str = "ok") -> str:
        """One rollout for the critique: its reward, task and calls."""
        head = f"reward: {'none (' + status + ')' if reward is None else format(reward, '.3g')}"
        return cut_text("\n".join([head, *self.lines(task, rollout)]), self.max_chars)

    def body(self, task: Any, rollout: AssembledRollout | None) -> str:
        """A rollout without its reward (what the reward judge reads): its task and calls, cut to ``max_chars``."""
        return cut_text("\n".join(self.lines(task, rollout)), self.max_chars)

    def lines(self, task: Any, rollout: AssembledRollout | None) -> list[str]:
        """The task (none when ``task`` is None), the rollout's error (if any) and its calls, one line each."""
        lines = [] if task is None else [f"task: {task_text(task)}"]
        if rollout is not None:
            if rollout.error:
                lines.append(f"error: {rollout.error}")
            if rollout.transitions and self.tokenizer is not None:
                lines.extend(self._calls(rollout.transitions))
            else:
                lines.extend(self._text_calls(rollout.rollout_id))
        return lines

    def _text_calls(self, rollout_id: str) -> list[str]:
        from spanrl.otlp_receiver.text_calls import chat_examples

        examples = chat_examples(self.store, rollout_id) if self.store is not None else []
        if not examples:
            return ["(the text of its model calls is not available)"]
        lines: list[str] = []
        for number, example in enumerate(examples, 1):
            *seen, reply = example["messages"]
            lines.append(f"call {number}:")
            lines.append(f"  model input: {json.dumps(seen, ensure_ascii=False)}")
            lines.append(f"  model output: {json.dumps(reply, ensure_ascii=False)}")
        return lines

    def _calls(self, transitions: Sequence[Transition]) -> list[str]:
        lines: list[str] = []
        before: tuple[int, ...] = ()
        for number, call in enumerate(transitions, 1):
            prompt = call.prompt_token_ids
            shown = prompt[len(before):] if before and prompt[: len(before)] == before else prompt
            agent = f" (agent {call.agent_name})" if call.agent_name else ""
            lines.append(f"call {number}{agent}:")
            lines.append(f"  model input{' (what is new)' if shown is not prompt else ''}: {self._decode(shown)}")
            lines.append(f"  model output: {self._decode(call.response_token_ids)}")
            before = prompt + call.response_token_ids
        return lines

    def _decode(self, ids: Sequence[int]) -> str:
        try:
            return json.dumps(self.tokenizer.decode(list(ids), skip_special_tokens=False), ensure_ascii=False)
        except Exception:  # noqa: BLE001 - ids of another model: the critique goes on without them
            return f"({len(ids)} tokens that this tokenizer cannot decode)"


def task_text(task: Any) -> str:
    try:
        return json.dumps(task, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError):
        return repr(task)


def cut_text(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars``: its start and end kept, the middle said to be left out."""
    if len(text) <= max_chars:
        return text
    marker = "\n[... {} characters left out ...]\n"
    keep = max(max_chars - len(marker) - 8, 2)
    head, tail = text[: keep // 2], text[len(text) - keep // 2:]
    return head + marker.format(len(text) - len(head) - len(tail)) + tail
