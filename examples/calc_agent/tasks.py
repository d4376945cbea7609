"""The calculator agent's task set: ``a+b``, ``a-b`` (operands up to 99) and ``a*b`` (b up to 9).

``python tasks.py --out tasks.jsonl --count 1000 --seed 0`` writes the dataset that
``spanrl train`` hands out; each line is ``{"id": ..., "question": "37+45", "answer": 82}``.
"""

from __future__ import annotations

import argparse
import json
import random


def make_task(rng: random.Random, index: int) -> dict:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 99), rng.randint(2, 9)
        answer = a * b
    elif op == "-":
        a, b = sorted((rng.randint(0, 99), rng.randint(0, 99)), reverse=True)
        answer = a - b
    else:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        answer = a + b
    return {"id": f"calc-{index}", "question": f"{a}{op}{b}", "answer": answer}


def make_tasks(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [make_task(rng, i) for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with open(args.out, "w", encoding="utf-8") as f:
        for task in make_tasks(args.count, args.seed):
            f.write(json.dumps(task) + "\n")


if __name__ == "__main__":
    main()
