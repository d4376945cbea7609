"""Reward of the AutoGen calculator agent: 1.0 when its final number is the gold answer, else 0.0.

The runner records the agent's return value (the last number of its reply) as the variable
``output``. Imported by the trainer (``reward: spanrl.examples.calc_autogen.reward:reward``), in the
main environment: it needs nothing of AutoGen.
"""

from __future__ import annotations


def number_match(answer: str, gold: int | float) -> float:
    try:
        return 1.0 if abs(float(answer) - float(gold)) < 1e-6 else 0.0
    except (TypeError, ValueError):
        return 0.0


def reward(task: dict, variables: dict) -> float:
    return number_match(str(variables.get("output", "")).strip(), task["answer"])
