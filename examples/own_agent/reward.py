"""Your reward function: ``spanrl train`` calls ``score(task, variables)`` for every finished rollout.

``task`` is the line of ``tasks.jsonl`` the agent ran on; ``variables`` holds what the agent
recorded, ``output`` being the value ``solve`` returned. Return a number (higher is better).
``train.yaml`` names it ``reward: reward:score`` (module ``reward``, beside the config file).
"""

from __future__ import annotations


def score(task: dict, variables: dict) -> float:
    return 1.0 if str(variables.get("output", "")).strip() == str(task["answer"]) else 0.0
