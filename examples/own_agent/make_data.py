"""Writes ``tasks.jsonl`` (what the agent is trained on) and ``demonstrations.jsonl`` (how a good
agent behaves: the warm start learns from them). ``spanrl init`` ran it; run it again with
``python make_data.py [SEED]``, or write these files from your own data.

A task is one JSON object a line; ``id`` names it, the rest is for your agent and reward.
A demonstration is one chat a line, ``{"messages": [...]}``, in the messages your agent sends.
Two in three show the calculator; one in three a direct guess that is a little off, so the
warm-started model sometimes skips the tool and is wrong: RL then learns when to use it.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from agent import SYSTEM_PROMPT


def make_task(rng: random.Random, index: int) -> dict:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    if rng.random() < 0.5:
        return {"id": f"task-{index}", "question": f"{a}+{b}", "answer": a + b}
    a, b = max(a, b), min(a, b)
    return {"id": f"task-{index}", "question": f"{a}-{b}", "answer": a - b}


def demonstration(task: dict, rng: random.Random) -> dict:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]
    if rng.random() < 2 / 3:
        messages += [{"role": "assistant", "content": f"CALC {task['question']}"},
                     {"role": "user", "content": f"RESULT {task['answer']}"},
                     {"role": "assistant", "content": f"ANSWER {task['answer']}"}]
    else:
        guess = task["answer"] + rng.choice([-1, 1]) * rng.randint(1, 9)
        messages.append({"role": "assistant", "content": f"ANSWER {guess}"})
    return {"messages": messages}


def write_data(folder: str | Path = ".", seed: int = 0, tasks: int = 500, demonstrations: int = 2000) -> None:
    rng = random.Random(seed)
    folder = Path(folder)
    with (folder / "tasks.jsonl").open("w", encoding="utf-8") as f:
        for index in range(tasks):
            f.write(json.dumps(make_task(rng, index)) + "\n")
    with (folder / "demonstrations.jsonl").open("w", encoding="utf-8") as f:
        for index in range(demonstrations):
            f.write(json.dumps(demonstration(make_task(rng, index), rng)) + "\n")


if __name__ == "__main__":
    write_data(Path(__file__).parent, seed=int(sys.argv[1]) if len(sys.argv) > 1 else 0)
