"""A test reward function: 1.0 when the task it is given carries its gold ``answer`` and the
agent's output does not (the agent never saw it), else 0.0."""

from __future__ import annotations


def reward(task: dict, variables: dict) -> float:
    return 1.0 if "answer" in task and task["answer"] not in str(variables.get("output", "")) else 0.0
