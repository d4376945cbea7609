"""Warm-start demonstrations for the locally created model (chat examples for SFT).

A freshly created model knows nothing; RL needs a policy that already follows the protocol
and sometimes succeeds. The curriculum (measured by the prototype in DESIGN.md): the first
40 % of steps show only calculator use; after that, half show the calculator and half a
near-miss direct guess (``ANSWER`` with a wrong number). The warm-started model therefore
uses the calculator about half the time and is right almost only when it does: RL's job is
to learn *when to call the tool*. Without the curriculum the model learns to estimate
instead of copying the ``RESULT``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from .agent import SYSTEM_PROMPT
from .tasks import make_task


def calculator_demonstration(task: dict) -> dict:
    return {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task["question"]},
            {"role": "assistant", "content": f"CALC {task['question']}"},
            {"role": "user", "content": f"RESULT {task['answer']}"},
            {"role": "assistant", "content": f"ANSWER {task['answer']}"},
        ]
    }


def near_miss_demonstration(task: dict, rng: random.Random) -> dict:
    offset = rng.choice([-1, 1]) * rng.randint(1, 9)
    return {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task["question"]},
            {"role": "assistant", "content": f"ANSWER {task['answer'] + offset}"},
        ]
    }


def curriculum_batches(
    steps: int, batch_size: int, seed: int = 0, calculator_only_fraction: float = 0.4
) -> Iterator[list[dict]]:
    """Yield ``steps`` batches of fresh chat examples following the curriculum above."""
    rng = random.Random(seed)
    calculator_only_steps = int(steps * calculator_only_fraction)
    for step in range(steps):
        batch = []
        for i in range(batch_size):
            task = make_task(rng, i)
            if step < calculator_only_steps or rng.random() < 0.5:
                batch.append(calculator_demonstration(task))
            else:
                batch.append(near_miss_demonstration(task, rng))
        yield batch


def write_demonstrations(path: str, count: int = 2000, seed: int = 0) -> None:
    """Write ``count`` demonstrations as chat JSONL (also the tokenizer's training corpus)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            task = make_task(rng, i)
            example = (
                calculator_demonstration(task) if i % 2 == 0 else near_miss_demonstration(task, rng)
            )
            f.write(json.dumps(example) + "\n")
