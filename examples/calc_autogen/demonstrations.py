"""Warm-start demonstrations of the AutoGen calculator agent for a locally created model.

Each demonstration is one run of ``agent.py``'s ``solver`` on a problem like the training ones
(fresh numbers: never a training or validation question, see ``problems.demonstration_problems``),
as AutoGen sends it (its system message, the ``calculator`` tool as autogen-ext offers it, the tool's replies), by
a demonstrator who uses the calculator for every sum but is sometimes hasty:

- with probability ``early_share`` it stops after some of the steps and replies with the
  calculator's last result, an intermediate number (wrong);
- otherwise it evaluates every step (copying the numbers from the question and from the tool's
  replies) and replies with the last result (right).

Both behaviours copy every number from the question or the tool's replies, so the warm model
learns to copy whichever it picks (a demonstrator who answered from memory would teach a small
model to guess numbers: it cannot multiply new two- and three-digit numbers in its head, and it
learned to guess the final answer after the tool too; docs/results.md, 2026-11-28). With
``early_share`` above one half the warm model's greedy choice is to stop early, and RL has to find
out from the reward that finishing pays: a decision, which carries over to new problems.
This module needs nothing of AutoGen (the warm start
runs in the trainer's environment): ``TOOL_SCHEMA`` is the tool exactly as autogen-ext sends it,
which the example's test checks against the prompt the policy served.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator

from spanrl.examples.example_data import weaker_share, write_tool_call_text

from .calculator import evaluate
from .problems import demonstration_problems

SYSTEM_PROMPT = "Solve the problem. Use calculator for arithmetic. Reply with the final number only."  # agent.py's
EARLY_SHARE = 0.6
TOOL_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
    "parameters": {"type": "object", "properties": {
        "expression": {"description": "expression", "title": "Expression", "type": "string"}},
        "required": ["expression"], "additionalProperties": False},
    "strict": False}}


def _calculator_call(expression: str, number: int) -> list[dict]:
    call_id = f"call_{number}"
    return [{"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": evaluate(expression)}]


def demonstration(task: dict, rng: random.Random, early_share: float = EARLY_SHARE) -> dict:
    """One run of the solver on ``task`` (``{"messages": [...], "tools": [...]}``)."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]
    steps = task["steps"]
    evaluated = rng.randint(1, len(steps) - 1) if rng.random() < early_share else len(steps)
    for number, expression in enumerate(steps[:evaluated]):
        messages += _calculator_call(expression, number)
    messages.append({"role": "assistant", "content": messages[-1]["content"]})
    return {"messages": messages, "tools": [TOOL_SCHEMA]}


def demonstration_batches(steps: int, batch_size: int, seed: int = 0,
                          early_share: float = EARLY_SHARE) -> Iterator[list[dict]]:
    """``steps`` batches of demonstrations, each on a fresh problem (never a training or validation one);
    the first batches show only the calculator route (``example_data.weaker_share``)."""
    rng = random.Random(seed)
    problems = demonstration_problems(random.Random(f"demonstrations-{seed}"))
    for step in range(steps):
        share = weaker_share(step, steps, early_share)
        yield [demonstration(next(problems), rng, share) for _ in range(batch_size)]


def write_demonstrations(path: str, count: int = 2000, seed: int = 0, early_share: float = EARLY_SHARE) -> None:
    rng = random.Random(seed)
    problems = demonstration_problems(random.Random(f"demonstrations-{seed}"))
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            f.write(json.dumps(demonstration(next(problems), rng, early_share)) + "\n")


def write_tokenizer_corpus(path: str, demonstrations_file: str) -> None:
    """Text the tokenizer also learns from: the tool schema and tool-call lines as the chat template
    writes them (the demonstrations' message contents leave them out)."""
    write_tool_call_text(path, demonstrations_file, "calculator", TOOL_SCHEMA)


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
