"""Validation: a held-out task file scored through the same runners, never trained on.

``spanrl train`` with ``val_tasks`` opens, after every ``val_every``-th step and after the
last one, a validation round: each held-out task ``val_attempts`` times, handed to the same
runners over the same bridge, served by the policy the step just published. The round's
rollouts are collected and scored exactly as training rollouts are
(``TrainingLoop.collect``), but they go into no update: their mean score is ``val_reward``
(``val/reward``) in that step's metrics row (and so in the plot and the trackers). Their rollout ids start with
``VALIDATION_PREFIX`` so the store keeps them apart (``spanrl sft --store`` skips them).

``spanrl train --val-only`` (``session.run_validation_only``) starts the backend on the model
(or, with ``--resume``, on the run's newest checkpoint), runs one validation round and returns
its result: no training, no metrics.jsonl. Used by ``session``.

Each round of a training run also appends one line to ``output_dir/validation.jsonl``
(``VALIDATION_LOG``): the step, the policy version, ``val_reward`` and ``task_scores``, each
held-out task's mean score over its scored attempts, so which tasks a run gets right can be
followed step by step (``bench/learning.py`` sums them by the tasks' ``kind``). A resumed run
that redoes a step appends its round again: a step's last line is the one that counts.

``score_round`` is the one function that scores a round of held-out attempts: validation rounds
run it, and so does ``spanrl eval`` (``evaluation.py``: a greedy round and a sampled one).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from spanrl.bridge_protocol import VALIDATION_ROLLOUT_PREFIX, Attempt
from spanrl.schema import metrics as keys
from spanrl.schema.tasks import Task, load_tasks

from .backend import PolicyBackend
from .loop_settings import LoopSettings
from .training_loop import TrainingLoop

logger = logging.getLogger(__name__)

VALIDATION_PREFIX = VALIDATION_ROLLOUT_PREFIX  # rollout ids of validation rounds: v<step>-<task>-a<n>-<hex>
RESULT_FILE = "validation.json"  # written by --val-only into output_dir
VALIDATION_LOG = "validation.jsonl"  # one line a round of a training run, in output_dir


@dataclass(frozen=True)
class ValidationResult:
    """One validation round: the mean score of its scored rollouts and what was left out."""

    step: int
    policy_version: int
    val_reward: float | None  # None when no rollout could be scored
    rollouts: int
    rollouts_scored: int
    left_out: dict[str, int]
    seconds: float
    task_scores: dict[str, float] = field(default_factory=dict)  # task id -> mean score of its scored attempts

    def as_metrics(self) -> dict[str, Any]:
        """The keys a metrics row takes (``val/reward`` only when there was a score)."""
        row: dict[str, Any] = {keys.VAL_ROLLOUTS: self.rollouts, keys.VAL_ROLLOUTS_SCORED: self.rollouts_scored,
                               keys.VAL_SECONDS: self.seconds}
        if self.val_reward is not None:
            row[keys.VAL_REWARD] = self.val_reward
        if self.left_out:
            row[keys.VAL_LEFT_OUT] = dict(self.left_out)
        return row


@dataclass(frozen=True)
class ScoredRound:
    """One round of held-out attempts, scored: what ``score_round`` returns (validation and ``spanrl eval``)."""

    attempts: list[Attempt]
    scores: dict[str, float]  # rollout id -> score, for the scored rollouts
    reasons: dict[str, str]  # rollout id -> why it was left out (``scoring.LEFT_OUT_*`` or an outcome)
    seconds: float

    @property
    def left_out(self) -> dict[str, int]:
        return dict(Counter(self.reasons.values()))

    def task_scores(self) -> dict[str, float]:
        """Each task's mean score over its scored attempts (a task none of whose attempts was scored is absent)."""
        by_task: dict[str, list[float]] = defaultdict(list)
        for attempt in self.attempts:
            if attempt.rollout_id in self.scores:
                by_task[attempt.task_id].append(self.scores[attempt.rollout_id])
        return {task_id: sum(scores) / len(scores) for task_id, scores in by_task.items()}


def score_round(loop: TrainingLoop, step: int, tasks: Sequence[Task], attempts_per_task: int,
                prefix: str = VALIDATION_PREFIX, on_idle: Callable[[float, int], None] | None = None,
                idle_after_s: float = 0.0) -> ScoredRound:
    """``attempts_per_task`` attempts of each task, handed to runners through ``loop``'s dispatcher and
    scored from its store exactly as training rollouts are (``TrainingLoop.collect``); nothing is trained.
    The one round of held-out scoring: validation rounds and ``spanrl eval`` (``evaluation.py``) both run it."""
    started = time.monotonic()
    # relaunched attempts in place of the faulted ones; with async_training, groups among the training ones
    attempts, outcomes = loop.dispatcher.run_round(step, tasks, attempts_per_task, prefix, on_idle, idle_after_s)
    report = loop.collect(attempts, outcomes, held_out=True)
    return ScoredRound(attempts, {item.attempt.rollout_id: item.score for item in report.scored},
                       dict(report.reasons), time.monotonic() - started)


class Validator:
    """The held-out tasks of ``settings.val_tasks`` and when to score them."""

    def __init__(self, settings: LoopSettings) -> None:
        self.settings = settings
        self.tasks = load_tasks(settings.val_tasks)

    def due(self, step: int) -> bool:
        """After step ``step`` (0-based), is a validation round due?"""
        done = step + 1
        return done % self.settings.val_every == 0 or done == self.settings.steps

    def run(self, loop: TrainingLoop, steps_done: int, backend: PolicyBackend,
            on_idle: Callable[[float, int], None] | None = None) -> ValidationResult:
        """One validation round through ``loop``'s dispatcher and store after ``steps_done``
        updates; nothing is trained."""
        scored = score_round(loop, steps_done, self.tasks, self.settings.val_attempts, on_idle=on_idle,
                             idle_after_s=self.settings.runner_wait_warn_s)
        scores = list(scored.scores.values())
        result = ValidationResult(
            step=steps_done, policy_version=backend.policy_version,
            val_reward=sum(scores) / len(scores) if scores else None, rollouts=len(scored.attempts),
            rollouts_scored=len(scores), left_out=scored.left_out, seconds=scored.seconds,
            task_scores=scored.task_scores(),
        )
        logger.info("validation after step %d (policy version %d): val_reward %s over %d of %d rollouts",
                    result.step, result.policy_version, result.val_reward, len(scores), len(scored.attempts))
        return result


def append_round(output_dir: str, result: ValidationResult) -> None:
    """Add one round to ``output_dir/validation.jsonl`` (``VALIDATION_LOG``)."""
    os.makedirs(output_dir, exist_ok=True)
    record = {key: value for key, value in asdict(result).items() if key != "seconds"}
    with open(os.path.join(output_dir, VALIDATION_LOG), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def validation_summary(result: ValidationResult) -> str:
    """What ``spanrl train --val-only`` prints."""
    score = "none (no rollout could be scored)" if result.val_reward is None else f"{result.val_reward:.4f}"
    left = ", ".join(f"{k} {v}" for k, v in sorted(result.left_out.items()))
    return (f"spanrl train --val-only: val_reward {score} over {result.rollouts_scored} of {result.rollouts} "
            f"rollouts (policy version {result.policy_version})" + (f"; left out: {left}" if left else ""))
