"""Logprobs in OpenAI's two shapes, from the engine's ids and values: chat (``content`` entries
with bytes and ``top_logprobs``) and completions (``tokens`` / ``token_logprobs`` /
``top_logprobs`` keyed by text / ``text_offset``). Called by the chat and completions routes,
for whole results and for single streamed tokens. A token's text is its own ``decode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spanrl.trainer_bridge.torch_backend.server.protocol import (
    ChatLogprobs,
    ChatLogprobToken,
    CompletionLogprobs,
    TopLogprob,
)

TopRow = Sequence[tuple[int, float]]  # (token id, logprob), most likely first


def _top_entry(tokenizer: Any, token_id: int, logprob: float) -> TopLogprob:
    text = tokenizer.decode([token_id])
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[float],
                  top: Sequence[TopRow] | None) -> ChatLogprobs:
    """One ``content`` entry per sampled token."""
    content = []
    for position, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=False)):
        text = tokenizer.decode([token_id])
        alternatives = [_top_entry(tokenizer, tid, lp) for tid, lp in top[position]] if top else []
        content.append(ChatLogprobToken(token=text, logprob=logprob, bytes=list(text.encode("utf-8")),
                                        top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[float],
                        top: Sequence[TopRow] | None) -> CompletionLogprobs:
    """OpenAI's legacy shape; two alternatives that print alike share one key, as OpenAI's do."""
    tokens = [tokenizer.decode([token_id]) for token_id in token_ids]
    offsets, position = [], 0
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=list(logprobs),
        top_logprobs=[{tokenizer.decode([tid]): lp for tid, lp in row} for row in top] if top else None,
        text_offset=offsets,
    )


__all__ = ["chat_logprobs", "completion_logprobs"]
