"""A rollout as the training loop scored it: the attempt it answered, its score, what to train.

Made by the loop's scoring (``trainer_bridge/scoring.py``) from an ``AssembledRollout`` of the
receiver's store; read by the sample builders (GRPO samples, rejection sampling), the
asynchronous loop's staleness filter and validation.
"""

from __future__ import annotations

from dataclasses import dataclass

from spanrl.bridge_protocol import Attempt

from .rollouts import Transition


@dataclass(frozen=True)
class ScoredRollout:
    """An ok rollout with its score and the transitions to train on (the selected agents')."""

    attempt: Attempt
    score: float
    transitions: tuple[Transition, ...]
    reward_source: str = ""  # shown by `spanrl inspect`: the reward function, or the events' sources
