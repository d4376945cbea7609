"""Warm-start demonstrations of the retrieval QA agent for a locally created model (chat examples).

A fresh model knows neither the agent's protocol nor how to read a search result. Each
demonstration is one run of the agent as ``agent.py`` makes it (its instructions, the ``search``
tool as the Agents SDK offers it, results as ``search.py`` returns them), by a demonstrator who
knows its world but is sometimes hasty. Its worlds are not the example's (``demonstration_world``:
other seeds, each with its own encyclopedia), so no demonstration answers a training or validation
question, and the model meets many names, which it must learn to copy rather than learn by heart:

- with probability ``early_share`` it stops after some of the hops and replies with the entity the
  last result names (a company's founder where the founder's birthplace was asked: wrong);
- otherwise it looks every hop up (``search`` with the entity's name, reads the result, searches
  the entity it found, ...) and replies with what the last result says (right).

Both behaviours copy every name from the question or the results (a demonstrator who answered
from memory taught the model to guess names, after a search too; docs/results.md, 2026-11-28).
With ``early_share`` above one half the warm model's greedy choice is to stop early, and RL has to
find out from the reward that following every hop pays: a decision, which carries over to new
questions.
``python -m spanrl.examples.retrieval_qa.demonstrations --out demos.jsonl --tokenizer-text tools.txt``
writes a file for ``spanrl sft`` / ``warm_start:`` and the tokenizer's corpus for
``spanrl model init --corpus``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import random
from collections.abc import Iterator

from spanrl.examples.example_data import weaker_share, write_tool_call_text

from .agent import INSTRUCTIONS, search
from .corpus import build_world, documents
from .questions import questions_about_company, questions_about_person
from .search import search_in

EARLY_SHARE = 0.6
# Worlds of the demonstrator: any seeds but the example's (corpus.WORLD_SEED). Several, so that the
# model meets many names and learns to copy them rather than learn a few by heart.
DEMONSTRATION_WORLD_SEEDS = tuple(range(4096, 4104))


@functools.cache
def demonstration_world(seed: int) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """One world of the demonstrator: its questions (about every subject, each with its ``world``
    seed) and its encyclopedia's texts. A question that names an entity of the example's world is
    left out."""
    world, example = build_world(seed), build_world()
    example_names = {*example.company_founder, *example.person_birthplace, *example.city_country,
                     *example.countries}
    asked = [question for company in sorted(world.company_founder)
             for question in questions_about_company(world, company)]
    asked += [question for person in sorted(world.person_birthplace)
              for question in questions_about_person(world, person)]
    kept = tuple({**question, "world": seed} for question in asked
                 if not example_names & {*question["hops"], question["answer"]})
    return kept, tuple(doc["text"] for doc in documents(world))


def demonstration_questions() -> list[dict]:
    """Every question of every world of the demonstrator."""
    return [question for seed in DEMONSTRATION_WORLD_SEEDS for question in demonstration_world(seed)[0]]


def tool_schema() -> dict:
    """``search`` as the policy server renders it: the Agents SDK's Responses tool (what the SDK
    sends) in the chat-completions form (``type`` and ``strict`` left out, as the server does).
    A copy of its own for each demonstration (the SDK's conversion is made once)."""
    return copy.deepcopy(_converted_tool_schema())


@functools.cache
def _converted_tool_schema() -> dict:
    from agents.models.openai_responses import Converter

    sent = Converter.convert_tools([search], handoffs=[]).tools[0]
    return {"type": "function", "function": {k: v for k, v in dict(sent).items() if k not in ("type", "strict")}}


def _search_call(query: str, number: int, texts: tuple[str, ...]) -> list[dict]:
    call_id = f"call_{number}"
    return [{"role": "assistant", "content": "", "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "search", "arguments": json.dumps({"query": query})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": search_in(texts, query)}]


def demonstration(task: dict, rng: random.Random, early_share: float = EARLY_SHARE) -> dict:
    """One run of the agent on ``task``, a question of one of the demonstrator's worlds
    (``{"messages": [...], "tools": [...]}``)."""
    _, texts = demonstration_world(task["world"])
    messages: list[dict] = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": task["question"]}]
    hops = task["hops"]
    looked_up = rng.randint(1, len(hops) - 1) if rng.random() < early_share else len(hops)
    for number, entity in enumerate(hops[:looked_up]):
        messages += _search_call(entity, number, texts)
    answer = task["answer"] if looked_up == len(hops) else hops[looked_up]  # what the last result names
    messages.append({"role": "assistant", "content": answer})
    return {"messages": messages, "tools": [tool_schema()]}


def demonstration_batches(steps: int, batch_size: int, seed: int = 0,
                          early_share: float = EARLY_SHARE) -> Iterator[list[dict]]:
    """``steps`` batches of demonstrations in the demonstrator's worlds; the first batches show only
    the look-up route (``example_data.weaker_share``)."""
    asked = demonstration_questions()
    rng = random.Random(seed)
    for step in range(steps):
        share = weaker_share(step, steps, early_share)
        yield [demonstration(rng.choice(asked), rng, share) for _ in range(batch_size)]


def write_demonstrations(path: str, count: int = 2000, seed: int = 0, early_share: float = EARLY_SHARE) -> None:
    asked = demonstration_questions()
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            f.write(json.dumps(demonstration(rng.choice(asked), rng, early_share)) + "\n")


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
    parser.add_argument("--early-share", type=float, default=EARLY_SHARE)
    parser.add_argument("--tokenizer-text", help="also write the tool-call text lines for `spanrl model init --corpus`")
    args = parser.parse_args()
    write_demonstrations(args.out, args.count, args.seed, args.early_share)
    if args.tokenizer_text:
        write_tokenizer_corpus(args.tokenizer_text, args.out)


if __name__ == "__main__":
    main()
