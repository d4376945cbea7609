"""Reward of the reply-format agent: 1.0 when the reply is the task's word in square brackets."""

from __future__ import annotations


def reward(task: dict, variables: dict) -> float:
    return 1.0 if str(variables.get("output", "")).strip() == f"[{task['word']}]" else 0.0
