"""A store's text-only LLM calls as chat examples, for ``spanrl sft --store`` to learn from.

A call served by a model that returns no token ids (a hosted API behind ``spanrl proxy``, a
teacher) is kept in the store as spans with its text (``call_text.py``) but gives no transition.
``chat_examples(store, rollout_id)`` finds a rollout's calls as assembly does (``kept_calls``:
duplicates of one call dropped), and for each one without engine token ids builds
``{"messages": [...the prompt..., the reply], "tools": [...]}``: the warm start
(``trainer_bridge/warm_start.py``) then tokenizes it with the student's own tokenizer and chat
template, as it does a demonstration. ``developer`` messages become ``system`` (chat templates
know that role). Torch-free.
"""

from __future__ import annotations

from typing import Any

from spanrl.otlp_receiver.assembly import has_token_ids, kept_calls
from spanrl.otlp_receiver.call_text import from_attributes
from spanrl.otlp_receiver.span_tree import records_from_bodies
from spanrl.otlp_receiver.store import SpanStore


def chat_example(attributes: dict[str, Any]) -> dict[str, Any] | None:
    """The chat example of one call's text attributes; None when its prompt or reply is missing."""
    chat = from_attributes(attributes)
    reply = chat.reply
    if not chat.messages or reply is None or not (reply.get("content") or reply.get("tool_calls")):
        return None
    messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in chat.messages]
    example: dict[str, Any] = {"messages": [*messages, {**reply, "role": "assistant"}]}
    if chat.tools:
        example["tools"] = chat.tools
    return example


def chat_examples(store: SpanStore, rollout_id: str) -> list[dict[str, Any]]:
    """The chat examples of a rollout's calls that came without engine token ids, in call order."""
    records = records_from_bodies(span.body for span in store.rollout_spans(rollout_id))
    if not records:
        return []
    examples = []
    for call in kept_calls(records):
        if has_token_ids(call):
            continue
        example = chat_example(call.attributes)
        if example is not None:
            examples.append(example)
    return examples


__all__ = ["chat_example", "chat_examples"]
