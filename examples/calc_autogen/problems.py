"""The AutoGen calculator example's tasks: multi-step word problems with gold answers.

Each problem comes from a template whose numbers are drawn at random (two- and three-digit, so
the products are beyond what a small model computes in its head); the gold answer is computed
here and ``steps`` holds the calculator expressions a careful solver evaluates, in order (the
second uses the first's result, ...). ``make_tasks(seed)`` draws the training and validation
problems with separate random streams, and validation never repeats a training question::

    python -m spanrl.examples.calc_autogen.problems --out-dir examples/calc_autogen   # train.jsonl, val.jsonl

Each line: ``{"id", "question", "answer": int, "steps": ["37*24", "888-158"], "kind"}``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from spanrl.examples.example_data import split_main

TRAIN_COUNT = 400
VALIDATION_COUNT = 60
NAMES = ("Ana", "Bo", "Cy", "Dee", "Eli", "Fay", "Gil", "Hal", "Ivy", "Jo")


def _boxes_sold(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.randint(12, 60), rng.randint(12, 40)
    c = rng.randint(10, a * b - 1)
    return (f"A shop has {a} boxes with {b} pens each. It sells {c} pens. How many pens are left?",
            [f"{a}*{b}", f"{a * b}-{c}"], a * b - c)


def _change(rng: random.Random) -> tuple[str, list[str], int]:
    name, a, b = rng.choice(NAMES), rng.randint(3, 19), rng.randint(12, 45)
    c = rng.randint(a * b + 1, a * b + 300)
    return (f"{name} buys {a} tickets at {b} dollars each and pays {c} dollars. How much change does {name} get?",
            [f"{a}*{b}", f"{c}-{a * b}"], c - a * b)


def _weeks(rng: random.Random) -> tuple[str, list[str], int]:
    a, b, c = rng.randint(100, 400), rng.randint(100, 400), rng.randint(3, 12)
    return (f"A train runs {a} km on Monday and {b} km on Tuesday. How far does it run in {c} such weeks?",
            [f"{a}+{b}", f"{a + b}*{c}"], (a + b) * c)


def _orchard(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.randint(11, 40), rng.randint(11, 40)
    c, d = rng.randint(10, 99), rng.randint(10, 99)
    return (f"A farm has {a} rows of {b} trees. {c} trees are cut down and {d} are planted. "
            "How many trees are there now?", [f"{a}*{b}", f"{a * b}-{c}", f"{a * b - c}+{d}"], a * b - c + d)


def _shared(rng: random.Random) -> tuple[str, list[str], int]:
    a, k, c = rng.randint(3, 12), rng.randint(12, 60), rng.randint(10, 99)
    return (f"{a} classes share {a * k} books equally. Each class then gets {c} more books. "
            "How many books does each class have?", [f"{a * k}/{a}", f"{k}+{c}"], k + c)


def _savings(rng: random.Random) -> tuple[str, list[str], int]:
    name, a, b, c = rng.choice(NAMES), rng.randint(15, 80), rng.randint(4, 20), rng.randint(20, 300)
    return (f"{name} saves {a} dollars a week for {b} weeks and then spends {c} dollars. "
            f"How much does {name} have left?", [f"{a}*{b}", f"{a * b}-{c}"], a * b - c)


KINDS: dict[str, Callable[[random.Random], tuple[str, list[str], int]]] = {
    "boxes_sold": _boxes_sold, "change": _change, "weeks": _weeks, "orchard": _orchard, "shared": _shared,
    "savings": _savings,
}


def draw(rng: random.Random, count: int, prefix: str, avoid: set[str]) -> list[dict]:
    tasks: list[dict] = []
    while len(tasks) < count:
        kind = rng.choice(sorted(KINDS))
        question, steps, answer = KINDS[kind](rng)
        if question in avoid:
            continue
        avoid.add(question)
        tasks.append({"id": f"{prefix}-{len(tasks)}", "question": question, "answer": answer, "steps": steps,
                      "kind": kind})
    return tasks


def make_tasks(seed: int = 0, train_count: int = TRAIN_COUNT,
               validation_count: int = VALIDATION_COUNT) -> tuple[list[dict], list[dict]]:
    """``(train, validation)``: different numbers, never the same question twice."""
    seen: set[str] = set()
    train = draw(random.Random(f"train-{seed}"), train_count, "calc", seen)
    validation = draw(random.Random(f"validation-{seed}"), validation_count, "calc-val", seen)
    return train, validation


def demonstration_problems(rng: random.Random) -> Iterator[dict]:
    """An endless stream of problems for the warm start's demonstrator, none of them a training or
    validation question. A demonstrator who solved only the 400 training problems would let a model
    memorise their answers (then answering from memory pays on the training problems and RL has
    nothing to learn there); fresh numbers every time leave the tool as the one route that works."""
    train, validation = make_tasks(seed=0)
    known = {task["question"] for task in train + validation}
    while True:
        kind = rng.choice(sorted(KINDS))
        question, steps, answer = KINDS[kind](rng)
        if question not in known:
            yield {"id": "demo", "question": question, "answer": answer, "steps": steps, "kind": kind}


def main() -> None:
    split_main(make_tasks, (__doc__ or "").splitlines()[0])


if __name__ == "__main__":
    main()
