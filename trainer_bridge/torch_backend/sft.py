"""Supervised warm start of the torch trainer: chat examples -> cross-entropy on assistant tokens.

``TorchTrainer.sft_steps`` / ``sft_loss`` / ``sft_from_jsonl`` call these functions (the demo,
``spanrl sft``, the ``warm_start:`` of ``spanrl train`` and ``bench/`` warm-start a model with
them before GRPO). An example is ``{"messages": [...]}``: the tokens learned are those a
serving engine samples after the chat template's generation prompt, each assistant message's
content and the ``<|im_end|>`` that closes it. Or a ``backend.TokenExample``: a call the
engine already served (prompt and response ids from the receiver's store), whose response ids
are learned as they are. A chat example may offer ``"tools"`` and hold tool calls (assistant
``tool_calls``, ``tool`` messages): they are rendered as the policy server renders them.
"""

from __future__ import annotations

import json
import random
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from spanrl.trainer_bridge.backend import TokenExample
from spanrl.trainer_bridge.torch_backend.batching import MaskedSequence
from spanrl.trainer_bridge.torch_backend.server.chat_format import render_chat

if TYPE_CHECKING:
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer


def encode_example(tokenizer: Any, example: Any) -> MaskedSequence:
    """``(ids, mask)`` of a chat example or a ``TokenExample`` (mask 1 on the tokens learned)."""
    if isinstance(example, TokenExample):
        prompt, response = list(example.prompt_token_ids), list(example.response_token_ids)
        return prompt + response, [0] * len(prompt) + [1] * len(response)
    return encode_chat_for_sft(tokenizer, messages_of(example), tools_of(example))


class EncodingCache:
    """Encodings of the chat examples one run of ``sft_steps`` has seen, by content.

    Warm-start batches draw the same demonstrations again and again (retrieval QA's 800 x 64
    draws hold 4,303 distinct examples, SQL's 6,477), and rendering the chat template per assistant
    turn and tokenizing is ~3 ms of single-threaded CPU an example: ~170 s of a retrieval warm
    start. The key is the example's JSON text (~40 µs); ``TokenExample``s, already ids, are not
    kept. At most ``max_entries`` are kept (~4 KB each), then new ones are encoded every time."""

    def __init__(self, tokenizer: Any, max_entries: int = 8192) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.encoded = 0  # examples rendered and tokenized (the rest came from the cache)
        self._entries: dict[str, tuple[array, bytes]] = {}

    def encode(self, example: Any) -> MaskedSequence:
        """``encode_example(example)``: the caller gets lists of its own."""
        key = self._key(example)
        kept = self._entries.get(key) if key is not None else None
        if kept is not None:
            return kept[0].tolist(), list(kept[1])
        self.encoded += 1
        ids, mask = encode_example(self.tokenizer, example)
        if key is not None and len(self._entries) < self.max_entries:
            self._entries[key] = (array("q", ids), bytes(mask))
        return ids, mask

    @staticmethod
    def _key(example: Any) -> str | None:
        if isinstance(example, TokenExample):
            return None
        try:
            return json.dumps(example, sort_keys=True)
        except (TypeError, ValueError):  # not JSON data: encoded each time
            return None


def sft_loss(trainer: TorchTrainer, examples: Sequence[Any]) -> float:
    """Mean cross-entropy on the assistant tokens of ``examples`` (no update)."""
    sequences = [encode_example(trainer.tokenizer, e) for e in examples]
    total_tokens = float(sum(sum(mask) for _, mask in sequences))
    loss = 0.0
    with torch.no_grad():
        for batch in trainer.token_batches(sequences):
            logprobs = trainer.token_logprobs(batch)
            loss += float(-(logprobs * batch.response_mask).sum()) / total_tokens
    return loss


def sft_steps(trainer: TorchTrainer, batches: Iterable[Sequence[Any]], lr: float | None = None,
              max_steps: int | None = None, progress: bool = True,
              on_step: Callable[[int, dict], None] | None = None) -> dict[str, float]:
    """Supervised steps: one AdamW step per batch of chat examples (see ``TorchTrainer.sft_steps``)."""
    from spanrl.progress import progress_bar

    rate = lr if lr is not None else trainer.config.sft_learning_rate
    if trainer.sft_optimizer is None:
        trainer.sft_optimizer = trainer.new_optimizer(rate)
    optimizer = trainer.sft_optimizer
    for group in optimizer.param_groups:
        group["lr"] = rate
    started = time.perf_counter()
    losses: list[float] = []
    tokens = 0
    bar = progress_bar(max_steps, "sft", unit="step", disable=not progress)
    trainer.model.train()
    cache = EncodingCache(trainer.tokenizer)
    for number, examples in enumerate(batches):
        if max_steps is not None and number >= max_steps:
            break
        sequences = [cache.encode(e) for e in examples]
        batch_tokens = float(sum(sum(mask) for _, mask in sequences))
        if batch_tokens == 0:
            raise ValueError(f"SFT batch {number} has no assistant tokens to learn")
        step_loss = 0.0
        for batch in trainer.token_batches(sequences):
            logprobs = trainer.token_logprobs(batch)
            loss = -(logprobs * batch.response_mask).sum() / batch_tokens
            loss.backward()
            step_loss += float(loss.detach())
        trainer.clip_and_step(optimizer)
        losses.append(step_loss)
        tokens += int(batch_tokens)
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.3f}")
        if on_step is not None:
            on_step(number, {"loss": step_loss, "tokens": batch_tokens})
    bar.close()
    if losses:
        trainer.policy_version += 1
    return {
        "steps": float(len(losses)),
        "loss_first": losses[0] if losses else float("nan"),
        "loss_last": losses[-1] if losses else float("nan"),
        "tokens": float(tokens),
        "examples_encoded": float(cache.encoded),
        "seconds": time.perf_counter() - started,
        "policy_version": float(trainer.policy_version),
    }


def sft_from_jsonl(trainer: TorchTrainer, path: str | Path, steps: int, batch_size: int = 64,
                   lr: float | None = None, seed: int = 0, progress: bool = True) -> dict[str, float]:
    """``sft_steps`` on random batches drawn from a chat JSONL file (one example a line)."""
    return sft_on_examples(trainer, load_chat_jsonl(path), steps, batch_size=batch_size, lr=lr, seed=seed,
                           progress=progress)


def sft_on_examples(trainer: TorchTrainer, examples: Sequence[Any], steps: int, batch_size: int = 64,
                    lr: float | None = None, seed: int = 0, progress: bool = True,
                    on_step: Callable[[int, dict], None] | None = None) -> dict[str, float]:
    """``sft_steps`` on ``steps`` batches of ``batch_size`` examples drawn at random from ``examples``."""
    if not examples:
        raise ValueError("no examples to learn from")
    rng = random.Random(seed)

    def batches() -> Iterator[list[Any]]:
        while True:
            yield [rng.choice(examples) for _ in range(batch_size)]

    return sft_steps(trainer, batches(), lr=lr, max_steps=steps, progress=progress, on_step=on_step)


def messages_of(example: Any) -> list[dict]:
    """The message list of an example (``{"messages": [...]}`` or the bare list)."""
    if isinstance(example, dict) and isinstance(example.get("messages"), list):
        return example["messages"]
    if isinstance(example, list):
        return example
    raise ValueError('an SFT example must be {"messages": [{"role": ..., "content": ...}, ...]}')


def tools_of(example: Any) -> list[dict] | None:
    """The functions an example offered the model (``"tools"``, chat-completions form), if any."""
    tools = example.get("tools") if isinstance(example, dict) else None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError('an SFT example\'s "tools" must be a list of {"type": "function", "function": {...}}')
    return tools or None


def _check_message(message: Any) -> None:
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError("every message needs a 'role'")
    if "content" not in message and not message.get("tool_calls"):
        raise ValueError("every message needs 'content' (an assistant message may have 'tool_calls' instead)")


def load_chat_jsonl(path: str | Path) -> list[dict]:
    """Chat examples from a JSONL file; a bad line raises an error naming its line number.
    An example may offer tools (``"tools"``) and contain tool calls: assistant messages with
    ``tool_calls`` and ``tool`` messages, rendered as the server renders them."""
    examples = []
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                messages = messages_of(record)
                for message in messages:
                    _check_message(message)
                tools = tools_of(record)
            except (json.JSONDecodeError, ValueError) as exc:
                raise ValueError(f"{path}:{number}: not a chat example: {exc}") from exc
            examples.append({"messages": messages, "tools": tools} if tools else {"messages": messages})
    if not examples:
        raise ValueError(f"{path} holds no chat examples")
    return examples


def encode_chat_for_sft(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> MaskedSequence:
    """``(ids, mask)`` for a chat: mask 1 on each assistant message's sampled tokens.

    For every assistant message ``i`` the ids before it are the chat template of
    ``messages[:i]`` (and ``tools``) with the generation prompt — exactly the prompt the server
    sends to the model (``chat_format.render_chat``) — and its tokens are the content and tool
    calls plus the end-of-turn token, up to the first eos that follows (the template's trailing
    newline is context, not learned).
    """
    def render(upto: int, generation_prompt: bool) -> list[int]:
        text = render_chat(tokenizer, messages[:upto], tools, add_generation_prompt=generation_prompt)
        return list(tokenizer.encode(text, add_special_tokens=False))

    eos = tokenizer.eos_token_id
    full = render(len(messages), False)
    mask = [0] * len(full)
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prefix = render(index, True)
        through = render(index + 1, False)
        start = len(prefix)
        if full[: len(through)] != through or through[:start] != prefix:
            start = _common_prefix(prefix, through)  # a template that re-tokenizes across the seam
        end = len(through)
        for position in range(start, len(through)):
            if through[position] == eos:
                end = position + 1
                break
        for position in range(start, min(end, len(full))):
            mask[position] = 1
    return full, mask


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
