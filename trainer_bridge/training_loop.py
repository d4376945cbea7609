"""The trainer bridge's loop: hand out tasks, collect rollouts from the store, GRPO, publish.

One step: open a round of ``tasks_per_step`` tasks x ``group_size`` attempts for runners;
wait until every attempt is reported (ok, failed, timed out, or lost with its runner); read
the assembled rollouts of the ok attempts from the receiver's store; score them
(``scoring.RolloutScorer``; with ``reward: judge``, then each group in one request to the judge:
``judge/group_judge.py``); turn every usable transition into a training sample with its group
advantage (``samples``); hand the samples to the backend (``backend.PolicyBackend.update``),
which trains and publishes the new policy at the same URL. Rollouts that failed, timed out,
never assembled, carry no usable transition or whose reward function raised are counted in the
metrics (``rollout/left_out``, ``spanrl.schema.metrics``) and never trained on. Run by ``session.run_training``, which
starts the backend; the loop never imports one.
"""

from __future__ import annotations

import logging
import random
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from spanrl.otlp_receiver import trained_rewards
from spanrl.schema import metrics as keys
from spanrl.schema.rollouts import AssembledRollout
from spanrl.schema.scored import ScoredRollout
from spanrl.schema.tasks import Task, load_tasks

from .backend import PolicyBackend, TrainingSample
from .loop_settings import LoopSettings
from .rejection_sampling import sft_samples, sft_update
from .samples import (
    TaskScores,
    groups_without_signal,
    sample_advantages,
    trained_rollout,
    training_samples,
    without_uniform_groups,
)
from .scoring import JUDGE_REWARD, LEFT_OUT_UNASSEMBLED, RolloutScorer
from .task_dispatch import Attempt, Outcome, TaskDispatcher, check_hidden_task_fields
from .trajectory_merge import update_rows

logger = logging.getLogger(__name__)

STORE_POLL_S = 0.1


@dataclass
class StepReport:
    """What one step saw: usable rollouts and the reasons the others were left out."""

    scored: list[ScoredRollout]
    left_out: Counter
    # what the receiver's checks counted in the step's rollouts (AssembledRollout.counters summed)
    receiver_counters: Counter = field(default_factory=Counter)
    # rollout id -> why it was left out (the reasons ``left_out`` counts); per-task results of ``spanrl eval``
    reasons: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StepUpdate:
    """What one step's update trained on and its statistics."""

    samples: list[TrainingSample]
    dropped: set[str]  # rollouts of a group of one (GRPO) or below sft_min_reward (SFT)
    groups_of_one: int
    stats: dict
    advantages: dict[tuple[str, int], float] | None = None  # (rollout id, turn) -> group advantage; None for SFT
    uniform_groups: int = 0  # groups left out by drop_uniform_groups (their rollouts are in ``dropped``)
    uniform_rollouts: int = 0


class TrainingLoop:
    """Tasks, rounds of attempts, and collecting and scoring their rollouts from the store."""

    def __init__(self, settings: LoopSettings) -> None:
        self.settings = settings
        self.tasks = load_tasks(settings.tasks)
        check_hidden_task_fields(settings.hidden_task_fields, self.tasks, settings.tasks)
        from spanrl.otlp_receiver.store import SpanStore

        self.store = SpanStore(settings.store)
        self.scorer = RolloutScorer(settings.reward, settings.python_path, settings.trust_agent_rewards,
                                    settings.agents, judge=settings.judge,
                                    air_per_call=settings.advantage_level == "transition", store=self.store)
        # held-out rollouts are scored by val_reward_fn when it is set (a shaped reward trains, the metric validates)
        self.held_out_scorer = self.scorer
        if settings.val_reward_fn:
            self.held_out_scorer = RolloutScorer(settings.val_reward_fn, settings.python_path,
                                                 settings.trust_agent_rewards, settings.agents, store=self.store)
        self.rng = random.Random(settings.seed)
        self.dispatcher = TaskDispatcher(settings.rollout_timeout_s, tuple(settings.hidden_task_fields),
                                         settings.relaunch_attempts)
        self._task_order: list[int] = []
        self.task_scores = TaskScores()  # what each task's rollouts scored over the run (for the summary)

        self.cursor = 0
        self.judge = None
        if settings.reward == JUDGE_REWARD:  # the judge scores each group of collected rollouts
            from .judge.group_judge import GroupJudge

            self.judge = GroupJudge(settings.judge, self.store, settings.store, settings.model)

    # --- rounds ----------------------------------------------------------------------------
    def next_tasks(self, count: int | None = None) -> list[Task]:
        """``count`` (default ``tasks_per_step``) tasks, each epoch in a fresh random order."""
        chosen: list[Task] = []
        while len(chosen) < (self.settings.tasks_per_step if count is None else count):
            if not self._task_order:
                self._task_order = list(range(len(self.tasks)))
                self.rng.shuffle(self._task_order)
            chosen.append(self.tasks[self._task_order.pop()])
        return chosen

    def collect(self, attempts: list[Attempt], outcomes: dict[str, Outcome], held_out: bool = False) -> StepReport:
        """Read the ok attempts' rollouts from the store and score them (``held_out``: as outcomes
        of held-out tasks, ``RolloutScorer.score``)."""
        reasons: dict[str, str] = {}
        waiting = {}
        for attempt in attempts:
            outcome = outcomes.get(attempt.rollout_id)
            status = outcome.status if outcome else "lost"
            if status == "ok":
                waiting[attempt.rollout_id] = attempt
            else:
                reasons[attempt.rollout_id] = status
        found = self.wait_for_rollouts(set(waiting))
        for rollout_id in waiting.keys() - found.keys():
            reasons[rollout_id] = LEFT_OUT_UNASSEMBLED
        scored = []
        receiver_counters: Counter = Counter()
        scorer = self.held_out_scorer if held_out else self.scorer
        for rollout_id, rollout in found.items():
            receiver_counters.update(rollout.counters)
            result = scorer.scored(waiting[rollout_id], rollout, held_out)
            if isinstance(result, str):
                reasons[rollout_id] = result
            else:
                scored.append(result)
        if self.judge is not None and scorer.judged:  # reward: judge: one request per group scores its members together
            scored = self.judge.score_groups(scored, found, reasons)
        return StepReport(scored, Counter(reasons.values()), receiver_counters, reasons)

    def wait_for_rollouts(self, rollout_ids: set[str]) -> dict[str, AssembledRollout]:
        """The assembled rollouts of ``rollout_ids`` that reach the store within ``assembly_wait_s``."""
        found: dict[str, AssembledRollout] = {}
        deadline = time.monotonic() + self.settings.assembly_wait_s
        while rollout_ids - found.keys():
            for rollout in self.new_rollouts():
                if rollout.rollout_id in rollout_ids:
                    found[rollout.rollout_id] = rollout
            if not (rollout_ids - found.keys()) or time.monotonic() > deadline:
                break
            time.sleep(STORE_POLL_S)
        return found

    def new_rollouts(self) -> list[AssembledRollout]:
        """Rollouts the store completed since the last call."""
        rollouts, self.cursor = self.store.completed_rollouts(since=self.cursor)
        return list(rollouts)

    def run_step(self, step: int, backend: PolicyBackend,
                 on_wait: Callable[[int, int], None] | None = None,
                 on_idle: Callable[[float, int], None] | None = None) -> dict:
        """One training step: a round of attempts, their rollouts, one update; its metrics row.

        ``on_idle(seconds, unclaimed)`` is called when no runner claimed an attempt for
        ``runner_wait_warn_s``. A step with no usable sample makes no update (the policy
        version stays). The reward and returns each scored rollout was trained with are
        recorded in the store for ``spanrl inspect``."""
        started = time.monotonic()
        self.dispatcher.open_round(step, self.next_tasks(), self.settings.group_size)
        outcomes = self.dispatcher.wait_round(on_wait=on_wait, on_idle=on_idle,
                                              idle_after_s=self.settings.runner_wait_warn_s)
        attempts = self.dispatcher.round_attempts()  # relaunched attempts in place of the faulted ones
        report = self.collect(attempts, outcomes)
        row = self.train_on(step, backend, attempts, report, time.monotonic() - started, started)
        row[keys.ROLLOUTS_RELAUNCHED] = dict(self.dispatcher.relaunched())
        return row

    def train_on(self, step: int, backend: PolicyBackend, attempts: list[Attempt], report: StepReport,
                 rollout_seconds: float, started: float) -> dict:
        """One update on ``report``'s scored rollouts, recorded for ``spanrl inspect``; the step's metrics row."""
        update = self.update(backend, report.scored)
        self.task_scores.add(report.scored)
        self.record_trained(step, report.scored, update)
        return step_row(step, backend.policy_version, attempts, report, update, rollout_seconds, started)

    @property
    def transition_returns(self) -> bool:
        """Whether each transition is scored by its own return: the agent's rewards, per transition,
        or a reward function's outcome plus the call's own intermediate rewards (AIR rules, per-call rewards)."""
        settings = self.settings
        return settings.advantage_level == "transition" and (
            (self.scorer.by_events and settings.trust_agent_rewards) or self.scorer.air_per_call)

    def update(self, backend: PolicyBackend, scored: list[ScoredRollout]) -> StepUpdate:
        """Samples of ``scored`` (rejection sampling, or GRPO's advantages, merged into rows with
        ``merge_trajectories``) and one update of ``backend`` on them (none without samples)."""
        settings = self.settings
        if settings.algorithm == "sft":  # rejection sampling: learn the good rollouts' calls (NLL)
            samples, rejected = sft_samples(scored, settings.sft_min_reward)
            stats = sft_update(backend, samples) if samples else {}
            stats["rollouts_below_sft_min_reward"] = len(rejected)
            return StepUpdate(samples, rejected, 0, stats)
        samples, dropped = training_samples(
            scored, settings.advantage_level, settings.norm_adv_by_std,
            transition_returns=self.transition_returns, loss_weighting=settings.loss_weighting,
            negative_advantage_scale=settings.negative_advantage_scale,
            positive_advantage_scale=settings.positive_advantage_scale, estimator=settings.advantage_estimator)
        uniform: set[str] = set()
        uniform_groups = 0
        if settings.drop_uniform_groups:
            samples, uniform, uniform_groups = without_uniform_groups(samples)
        rows, merge_metrics = update_rows(samples, settings.merge_trajectories)
        stats = backend.update(rows).as_metrics() if rows else {}
        return StepUpdate(samples, dropped | uniform, len(dropped), {**stats, **merge_metrics},
                          sample_advantages(samples), uniform_groups, len(uniform))

    def record_trained(self, step: int, scored: list[ScoredRollout], update: StepUpdate) -> None:
        """What each scored rollout was trained with, in the store (``spanrl inspect`` and
        ``spanrl dashboard`` show it)."""
        try:
            trained_rewards.record(self.settings.store, [
                trained_rollout(step + 1, item, self.transition_returns,
                                item.attempt.rollout_id not in update.dropped, update.advantages)
                for item in scored
            ])
        except sqlite3.Error as exc:  # what inspect shows must not stop training
            logger.warning("could not record the rewards of step %d in %s: %s", step + 1, self.settings.store, exc)


def step_row(step: int, policy_version: int, attempts: list[Attempt], report: StepReport, update: StepUpdate,
             rollout_seconds: float, started: float) -> dict:
    """One line of metrics.jsonl (its keys: ``spanrl.schema.metrics``)."""
    scores = [s.score for s in report.scored]
    groups, flat_groups = groups_without_signal(report.scored)
    row = {
        keys.STEP: step + 1,  # updates done so far: step k published policy version k
        keys.REWARD_MEAN: sum(scores) / len(scores) if scores else 0.0,
        keys.POLICY_VERSION: policy_version,
        keys.TRANSITIONS: len(update.samples),
        keys.ROLLOUTS: len(attempts),
        keys.ROLLOUTS_USED: len(report.scored) - update.groups_of_one - update.uniform_rollouts,
        keys.ROLLOUTS_LEFT_OUT: dict(report.left_out),
        keys.RECEIVER_COUNTERS: dict(report.receiver_counters),  # rewards clipped, rejected, replayed, ...
        keys.GROUPS_OF_ONE_DROPPED: update.groups_of_one,
        keys.UNIFORM_GROUPS_DROPPED: update.uniform_groups,
        keys.GROUPS: groups,
        keys.GROUPS_WITHOUT_SIGNAL: flat_groups,
        keys.ROLLOUTS_PER_S: len(attempts) / max(rollout_seconds, 1e-9),
        keys.ROLLOUT_SECONDS: rollout_seconds,  # waiting for the step's rollouts
        keys.STEP_SECONDS: time.monotonic() - started,
    }
    for name, value in update.stats.items():  # the update's own statistics (loss, kl, ...), under actor/
        if name in ("step", "policy_version") or not isinstance(value, (int, float)):
            continue  # the row's own
        key = keys.UPDATE_SECONDS if name == "seconds" else keys.LEGACY_KEYS.get(name) or keys.actor_key(name)
        row[key] = float(value)
    return row
