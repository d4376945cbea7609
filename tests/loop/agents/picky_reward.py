"""A reward function for the loop tests: 1.0 for the right answer, and it raises on tasks that
say ``"reward": "raise"`` (a user's reward function with a bug). Does not import spanrl."""

from __future__ import annotations


def reward(task: dict, variables: dict) -> float:
    if task.get("reward") == "raise":
        raise KeyError(f"picky_reward: no grading rule for task {task['id']}")
    return 1.0 if str(variables.get("answer")) == str(task["answer"]) else 0.0
