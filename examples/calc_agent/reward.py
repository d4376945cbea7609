"""Reward of the calculator agent: 1.0 for the right answer, else 0.0.

Named in the training config as ``reward: spanrl.examples.calc_agent.reward:reward``; the
trainer calls it with the task and the rollout's semantic variables (the runner records the
agent's return value as the variable ``output``).
"""

from __future__ import annotations


def reward(task: dict, variables: dict) -> float:
    output = str(variables.get("output", "")).strip()
    return 1.0 if output == str(task["answer"]) else 0.0
