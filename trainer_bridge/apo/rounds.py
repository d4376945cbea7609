"""APO's rounds of rollouts: candidates run side by side through the loop's runners and rewards.

One round of ``CandidateRounds.evaluate``: the same batch of training tasks for every candidate
(``apo.batch_tasks`` x ``apo.attempts``), one round of the loop's dispatcher holding them all;
before any runner can claim an attempt, the policy endpoint is told which candidate each rollout
gets (``POST /spanrl/v1/prompts`` with ``rollouts``), so the agent runs unchanged and the
endpoint serves that candidate's instructions in its place. ``validate`` does the same with
the held-out tasks (``val_tasks`` x ``val_attempts``, validation rollout ids, never trained on).

Each rollout is scored as the loop scores (``reward``, ``trust_agent_rewards``), but needs no
token ids (APO through ``spanrl proxy`` to a hosted model has none): a rollout that failed, timed
out or got no reward counts 0 for its candidate (the prompt made the agent fail); one lost with
its runner, never assembled or whose reward function raised does not count (no verdict on the
prompt). Called by ``apo/run.py``; torch-free.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spanrl.bridge_protocol import TRAINING_ROLLOUT_PREFIX, VALIDATION_ROLLOUT_PREFIX, Attempt
from spanrl.schema.rollouts import AssembledRollout
from spanrl.schema.tasks import Task

from ..scoring import (
    LEFT_OUT_FAILED,
    LEFT_OUT_NO_REWARD,
    LEFT_OUT_REWARD_ERROR,
    LEFT_OUT_UNASSEMBLED,
    RewardFunctionError,
)
from ..task_dispatch import STATUS_LOST
from .config import ApoConfig
from .search import Candidate, Evaluation

if TYPE_CHECKING:  # the loop's modules import the settings, which hold the apo: block (no circle)
    from ..training_loop import TrainingLoop

logger = logging.getLogger(__name__)

NOT_COUNTED = (STATUS_LOST, LEFT_OUT_UNASSEMBLED, LEFT_OUT_REWARD_ERROR)


@dataclass(frozen=True)
class RolloutResult:
    """One rollout of a candidate: its attempt, its reward (None: does not count), what ended it."""

    attempt: Attempt
    reward: float | None
    status: str  # "ok", or why it scored 0 / does not count
    rollout: AssembledRollout | None


class CandidateRounds:
    """Runs candidates of one prompt resource through the loop's dispatcher (module docstring)."""

    def __init__(self, loop: TrainingLoop, endpoint: Any, resource: str, config: ApoConfig,
                 val_tasks: Sequence[Task], val_attempts: int, first_round_id: int = 0,
                 on_idle: Callable[[float, int], None] | None = None) -> None:
        self.loop, self.endpoint, self.resource, self.config = loop, endpoint, resource, config
        self.val_tasks, self.val_attempts = list(val_tasks), val_attempts
        self.round_id = first_round_id  # numbers the rollout ids of every round of the run
        self.on_idle = on_idle
        self.known: dict[str, str] = {}  # every candidate the endpoint has: name -> text
        self.active: str | None = None  # the resource's active candidate, kept while candidates are added
        self.counts: Counter = Counter()  # since the last take_counts(): "rollouts", left-out reasons
        self.rewards: list[float] = []  # training rollouts' rewards since the last take_counts()
        self.seconds = 0.0

    def evaluate(self, candidates: Sequence[Candidate], number: int) -> dict[str, Evaluation]:
        """Every candidate on the same fresh batch of training tasks."""
        tasks = self.loop.next_tasks(self.config.batch_tasks)
        results = self._run(candidates, tasks, self.config.attempts, TRAINING_ROLLOUT_PREFIX)
        evaluations = {}
        for candidate in candidates:
            evaluation = Evaluation(candidate)
            for result in results[candidate.name]:
                evaluation.rollouts.append(result)
                if result.reward is not None:
                    evaluation.rewards.append(result.reward)
                    self.rewards.append(result.reward)
            evaluations[candidate.name] = evaluation
        return evaluations

    def validate(self, candidates: Sequence[Candidate], number: int) -> dict[str, float | None]:
        """Every candidate's mean reward on the held-out tasks (None: no rollout counted)."""
        results = self._run(candidates, self.val_tasks, self.val_attempts, VALIDATION_ROLLOUT_PREFIX)
        scores: dict[str, float | None] = {}
        for candidate in candidates:
            rewards = [r.reward for r in results[candidate.name] if r.reward is not None]
            scores[candidate.name] = sum(rewards) / len(rewards) if rewards else None
        return scores

    def take_counts(self) -> tuple[Counter, list[float], float]:
        """The rollouts counted since the last call (reasons), their rewards and seconds; reset."""
        taken = (self.counts, self.rewards, self.seconds)
        self.counts, self.rewards, self.seconds = Counter(), [], 0.0
        return taken

    def serve(self, candidates: Sequence[Candidate], active: str | None) -> None:
        """Give the endpoint these candidates (with those it has) and make ``active`` the one every
        call without an assignment gets."""
        self.known.update({c.name: c.text for c in candidates})
        self.active = active
        self.endpoint.update(self.resource, candidates=dict(self.known), active=active)

    def _run(self, candidates: Sequence[Candidate], tasks: Sequence[Task], attempts: int,
             prefix: str) -> dict[str, list[RolloutResult]]:
        started = time.monotonic()
        new = [c for c in candidates if self.known.get(c.name) != c.text]
        if new:
            self.serve(new, self.active)
        round_tasks = [task for _ in candidates for task in tasks]
        per_candidate = len(tasks) * attempts
        assigned: dict[str, str] = {}

        def assign(opened: list[Attempt]) -> None:
            for index, attempt in enumerate(opened):
                assigned[attempt.rollout_id] = candidates[index // per_candidate].name
            self.endpoint.update(self.resource, rollouts=assigned)

        self.round_id += 1
        opened = self.loop.dispatcher.open_round(self.round_id, round_tasks, attempts, prefix=prefix,
                                                 before_open=assign)
        outcomes = self.loop.dispatcher.wait_round(on_idle=self.on_idle,
                                                   idle_after_s=self.loop.settings.runner_wait_warn_s)
        ok = {a.rollout_id for a in opened if (o := outcomes.get(a.rollout_id)) is not None and o.status == "ok"}
        found = self.loop.wait_for_rollouts(ok)
        results: dict[str, list[RolloutResult]] = {c.name: [] for c in candidates}
        for attempt in opened:
            outcome = outcomes.get(attempt.rollout_id)
            result = self._result(attempt, outcome.status if outcome else STATUS_LOST, found.get(attempt.rollout_id))
            results[assigned[attempt.rollout_id]].append(result)
            self.counts["rollouts"] += 1
            if result.status != "ok":
                self.counts[result.status] += 1
        self.seconds += time.monotonic() - started
        return results

    def _result(self, attempt: Attempt, status: str, rollout: AssembledRollout | None) -> RolloutResult:
        if status != "ok":  # the runner's verdict: failed, timeout (0) or lost (not counted)
            return RolloutResult(attempt, None if status in NOT_COUNTED else 0.0, status, None)
        if rollout is None:
            return RolloutResult(attempt, None, LEFT_OUT_UNASSEMBLED, None)
        if rollout.status != "ok":
            return RolloutResult(attempt, 0.0, LEFT_OUT_FAILED, rollout)
        try:
            score = self.loop.scorer.score(attempt, rollout)
        except RewardFunctionError:
            return RolloutResult(attempt, None, LEFT_OUT_REWARD_ERROR, rollout)
        if score is None:
            return RolloutResult(attempt, 0.0, LEFT_OUT_NO_REWARD, rollout)
        return RolloutResult(attempt, score, "ok", rollout)
