"""Warm-start demonstrations of the retrieval QA agent for a locally created model (chat examples).

A fresh model knows neither the agent's protocol nor how to read a search result. Each
demonstration is one run of the agent on a training question, as ``agent.py`` makes it (its
instructions, the ``search`` tool as the Agents SDK offers it, the results ``search.py`` returns),
by a demonstrator who knows the world:

- with probability ``memory_share`` it answers at once from its own knowledge (the right answer,
  as the demonstrator knows it);
- otherwise it looks every hop up (``search`` with the entity's name, reads the result, searches
  the entity it found, ...) and answers with what the last result says.

The model cannot know the facts of questions it was never shown, so imitating the first
behaviour fails on new questions while the second generalises. With ``memory_share`` above one
half the warm model's greedy choice is to answer at once, and RL has to find out from the reward
that looking up pays: a decision, which carries over to new questions.
``python -m spanrl.examples.retrieval_qa.demonstrations --out demos.jsonl --tokenizer-text tools.txt``
writes a file for ``spanrl sft`` / ``warm_start:`` and the tokenizer's corpus for
``spanrl model init --corpus``.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
from collections.abc import Iterator

from spanrl.examples.example_data import write_tool_call_text

from .agent import INSTRUCTIONS, search
from .questions import make_tasks
from .search import search as search_documents

MEMORY_SHARE = 0.6


@functools.cache
def tool_schema() -> dict:
    """``search`` as the policy server renders it: the Agents SDK's Responses tool (what the SDK
    sends) in the chat-completions form (``type`` and ``strict`` left out, as the server does)."""
    from agents.models.openai_responses import Converter

    sent = Converter.convert_tools([search], handoffs=[]).tools[0]
    return {"type": "function", "function": {k: v for k, v in dict(sent).items() if k not in ("type", "strict")}}


def _search_call(query: str, number: int) -> list[dict]:
    call_id = f"call_{number}"
    return [{"role": "assistant", "content": "", "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "search", "arguments": json.dumps({"query": query})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": search_documents(query)}]


def demonstration(task: dict, rng: random.Random, memory_share: float = MEMORY_SHARE) -> dict:
    """One run of the agent on ``task`` (``{"messages": [...], "tools": [...]}``)."""
    messages: list[dict] = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": task["question"]}]
    hops = task["hops"]
    looked_up = 0 if rng.random() < memory_share else len(hops)
    for number, entity in enumerate(hops[:looked_up]):
        messages += _search_call(entity, number)
    messages.append({"role": "assistant", "content": task["answer"]})
    return {"messages": messages, "tools": [tool_schema()]}


def demonstration_batches(steps: int, batch_size: int, seed: int = 0,
                          memory_share: float = MEMORY_SHARE) -> Iterator[list[dict]]:
    """``steps`` batches of demonstrations on the training questions (never validation's)."""
    train, _ = make_tasks(seed=0)
    rng = random.Random(seed)
    for _ in range(steps):
        yield [demonstration(rng.choice(train), rng, memory_share) for _ in range(batch_size)]


def write_demonstrations(path: str, count: int = 2000, seed: int = 0, memory_share: float = MEMORY_SHARE) -> None:
    train, _ = make_tasks(seed=0)
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            f.write(json.dumps(demonstration(rng.choice(train), rng, memory_share)) + "\n")


def write_tokenizer_corpus(path: str, demonstrations_file: str) -> None:
    """Text the tokenizer also learns from: the tool schema and tool-call lines as the chat template
    writes them, and the corpus (the demonstrations' message contents leave these out)."""
    from .corpus import load_corpus

    write_tool_call_text(path, demonstrations_file, "search", tool_schema(), (doc["text"] for doc in load_corpus()))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-share", type=float, default=MEMORY_SHARE)
    parser.add_argument("--tokenizer-text", help="also write the tool-call text lines for `spanrl model init --corpus`")
    args = parser.parse_args()
    write_demonstrations(args.out, args.count, args.seed, args.memory_share)
    if args.tokenizer_text:
        write_tokenizer_corpus(args.tokenizer_text, args.out)


if __name__ == "__main__":
    main()
