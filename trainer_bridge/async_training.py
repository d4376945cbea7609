"""Asynchronous, off-policy training: update on the groups that finished while others still run.

The synchronous loop (``training_loop.TrainingLoop``) opens a round of ``tasks_per_step``
groups and waits for its slowest rollout before it updates. With ``async_training: true``
``AsyncTrainingLoop`` keeps ``tasks_per_step * (1 + max_staleness)`` groups in flight
(``GroupDispatcher``: one long-lived round that groups are added to and taken from); a step
takes the first ``tasks_per_step`` groups whose attempts have all ended, oldest (first
dispatched) first, and updates on them, while runners keep working on the others, which then
finish under the new policy. Admission is paced (``groups_to_open``): a group in flight already
``max_staleness`` versions behind and still running holds back one new group, so runners finish it before it goes
stale instead of starting fresh work. Validation rounds (``val_tasks``) run as held-out groups
among the training ones (``GroupDispatcher.run_round``), never trained on.

Staleness of a rollout: the current policy version minus the oldest version that generated
one of its calls (``Transition.policy_version``; the version at dispatch when the engine did
not say). Rollouts more than ``max_staleness`` versions behind are dropped (left out as
``stale``). Those behind but within the bound are ``off_policy_rollouts: correct``: trained
with truncated importance sampling (the backend weighs each token by
``min(exp(old logprob - engine logprob), is_truncation)``: ``torch_backend/losses.py``, or
verl's own rollout correction, ``verl_backend/off_policy.py``), or
``drop``: left out as ``off_policy``. Both are counted in the step's metrics
(``rollout/off_policy``, ``rollout/policy_lag_mean``, ``rollout/left_out``).

Chosen by ``session.run_training`` when ``settings.async_training``; the bridge API
serves ``GroupDispatcher`` exactly as it serves the synchronous ``TaskDispatcher``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spanrl.bridge_protocol import TRAINING_ROLLOUT_PREFIX, new_rollout_id
from spanrl.schema import metrics as keys
from spanrl.schema.rollouts import AssembledRollout, Transition
from spanrl.schema.scored import ScoredRollout
from spanrl.schema.tasks import Task

from .backend import PolicyBackend
from .loop_settings import LoopSettings
from .task_dispatch import Attempt, Outcome, TaskDispatcher, _Round
from .training_loop import StepReport, TrainingLoop

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinishedGroup:
    """The attempts of one task's GRPO group, all ended, with their outcomes."""

    attempts: tuple[Attempt, ...]
    outcomes: dict[str, Outcome]
    dispatched_at_version: int


class GroupDispatcher(TaskDispatcher):
    """A ``TaskDispatcher`` whose single round never closes: groups are added while earlier
    ones still run, and ``take_finished_groups`` removes the ones whose attempts all ended."""

    def __init__(self, rollout_timeout_s: float, hidden_task_fields: tuple[str, ...] = (),
                 relaunch_attempts: int = 0) -> None:
        super().__init__(rollout_timeout_s, hidden_task_fields, relaunch_attempts)
        self._round = _Round(step=0, attempts={})
        self._groups: dict[str, tuple[list[str], int]] = {}  # group key -> (rollout ids, version), oldest first
        self._held_out: set[str] = set()  # keys of validation groups (``run_round``)

    def add_groups(self, step: int, tasks: Sequence[Task], group_size: int, policy_version: int,
                   prefix: str = TRAINING_ROLLOUT_PREFIX, held_out: bool = False) -> list[Attempt]:
        """Queue a group of ``group_size`` attempts for each ``(task_id, task)``; its attempts.
        ``held_out`` groups (validation) go first to the runners and are never taken for training."""
        added: list[Attempt] = []
        with self._lock:
            current = self._round
            assert current is not None
            for task_id, task in tasks:
                key = f"{prefix}{step}-{task_id}-{uuid.uuid4().hex[:8]}"
                ids = []
                for number in range(group_size):
                    rollout_id = new_rollout_id(prefix, step, task_id, number)
                    attempt = Attempt(rollout_id, task_id, number, task, step)
                    current.attempts[rollout_id] = attempt
                    ids.append(rollout_id)
                    added.append(attempt)
                self._groups[key] = (ids, policy_version)
                if held_out:
                    self._held_out.add(key)
            new_ids = [a.rollout_id for a in added]
            if held_out:
                current.unclaimed.extendleft(reversed(new_ids))
            else:
                current.unclaimed.extend(new_ids)
                current.step = step
            self._lock.notify_all()
        return added

    def run_round(self, step: int, tasks: Sequence[Task], group_size: int, prefix: str,
                  on_idle: Callable[[float, int], None] | None = None,
                  idle_after_s: float = 0.0) -> tuple[list[Attempt], dict[str, Outcome]]:
        """A validation round among the training groups: held-out groups that runners claim first;
        wait for them to end and remove them (never trained on); their attempts and outcomes."""
        added = self.add_groups(step, tasks, group_size, -1, prefix=prefix, held_out=True)
        wanted = {a.rollout_id for a in added}
        with self._lock:
            keys = [k for k, (ids, _) in self._groups.items() if k in self._held_out and wanted & set(ids)]
            self._wait(lambda: all(self._ended_group(k) for k in keys), None, on_idle, idle_after_s, 0.2)
            groups = [self._remove(k) for k in keys]
            self._held_out.difference_update(keys)
        return [a for g in groups for a in g.attempts], {k: v for g in groups for k, v in g.outcomes.items()}

    def _replaced(self, old_id: str, new_id: str) -> None:
        """A relaunched attempt stays in its group (under the lock)."""
        for ids, _ in self._groups.values():
            if old_id in ids:
                ids[ids.index(old_id)] = new_id
                return

    @property
    def groups_in_flight(self) -> int:
        """Training groups added and not taken yet (running, waiting for a runner, or finished)."""
        with self._lock:
            return len(self._groups) - len(self._held_out)

    def versions_running(self) -> list[int]:
        """The dispatch version of each training group with attempts still running or waiting, oldest first."""
        with self._lock:
            return [version for key, (_, version) in self._groups.items()
                    if key not in self._held_out and not self._ended_group(key)]

    def knows(self, rollout_id: str) -> bool:
        """True while ``rollout_id`` belongs to a group not taken yet."""
        with self._lock:
            return self._round is not None and rollout_id in self._round.attempts

    def _ended_group(self, key: str) -> bool:
        current = self._round
        assert current is not None
        return all(i in current.outcomes for i in self._groups[key][0])

    def _finished_training_groups(self) -> list[str]:
        """Keys of the training groups whose attempts all ended, oldest (first dispatched) first."""
        return [key for key in self._groups if key not in self._held_out and self._ended_group(key)]

    def take_finished_groups(self, count: int, poll_s: float = 0.2,
                             on_wait: Callable[[int, int], None] | None = None,
                             on_idle: Callable[[float, int], None] | None = None,
                             idle_after_s: float = 30.0) -> list[FinishedGroup]:
        """Block until ``count`` training groups (or all there are, if fewer) have every attempt
        ended; remove and return them, oldest first. ``on_wait(finished groups, count)`` and
        ``on_idle`` as ``TaskDispatcher.wait_round``."""
        with self._lock:
            count = min(count, len(self._groups) - len(self._held_out))
            self._wait(lambda: len(self._finished_training_groups()) >= count,
                       None if on_wait is None else lambda: on_wait(len(self._finished_training_groups()), count),
                       on_idle, idle_after_s, poll_s)
            return [self._remove(key) for key in self._finished_training_groups()[:count]]

    def _wait(self, ready: Callable[[], bool], on_wait: Callable[[], None] | None,
              on_idle: Callable[[float, int], None] | None, idle_after_s: float, poll_s: float) -> None:
        """Under the lock: wait until ``ready()`` (or training finished), expiring lost attempts and
        saying when no runner claimed one for ``idle_after_s``."""
        current = self._round
        assert current is not None
        said_at = time.monotonic()
        while True:
            self._expire_lost(current)
            if ready() or self._finished:
                return
            now = time.monotonic()
            quiet_since = max(self._last_claim_at or 0.0, said_at)
            if idle_after_s > 0 and current.unclaimed and now - quiet_since >= idle_after_s:
                said_at = now
                if on_idle is not None:
                    on_idle(now - (self._last_claim_at or said_at), len(current.unclaimed))
                else:
                    logger.warning("%d attempts wait: no runner claimed one for %.0f s", len(current.unclaimed),
                                   idle_after_s)
            if on_wait is not None:
                on_wait()
            self._lock.wait(poll_s)

    def _remove(self, key: str) -> FinishedGroup:
        current = self._round
        assert current is not None
        ids, version = self._groups.pop(key)
        attempts = tuple(current.attempts.pop(i) for i in ids)
        outcomes = {i: current.outcomes.pop(i) for i in ids if i in current.outcomes}
        for i in ids:
            current.claimed_at.pop(i, None)
            current.relaunches.pop(i, None)
        current.by_claim_id = {c: r for c, r in current.by_claim_id.items() if r not in ids}
        return FinishedGroup(attempts, outcomes, version)


def groups_to_open(capacity: int, in_flight: int, versions_running: Sequence[int], current_version: int,
                   max_staleness: int) -> int:
    """How many groups a step opens (admission pacing): up to ``capacity`` groups in flight, less
    one for each still running group already ``max_staleness`` (at least 1) versions behind. Such a
    group goes stale at the next update unless it ends first; new work would only compete with it
    for runners."""
    at_limit = sum(1 for version in versions_running if current_version - version >= max(max_staleness, 1))
    return max(0, capacity - in_flight - at_limit)


def rollout_lag(transitions: Sequence[Transition], dispatched_at_version: int, current_version: int) -> int:
    """Policy versions between the oldest policy that generated one of ``transitions`` (the
    dispatch version where a transition does not say) and ``current_version``."""
    versions = [t.policy_version if t.policy_version is not None else dispatched_at_version for t in transitions]
    return max(0, current_version - min(versions, default=dispatched_at_version))


@dataclass(frozen=True)
class StalenessReport:
    """What ``filter_stale`` kept and why it left the others out."""

    kept: list[ScoredRollout]
    off_policy: int  # rollouts behind the current version (kept and corrected, or dropped)
    stale_dropped: int  # beyond max_staleness
    off_policy_dropped: int  # within it, left out by off_policy_rollouts: drop
    lag_mean: float


def filter_stale(scored: Sequence[ScoredRollout], dispatch_versions: dict[str, int], current_version: int,
                 max_staleness: int, off_policy_rollouts: str) -> StalenessReport:
    """Split ``scored`` by staleness (module docstring): keep the on-policy ones and, with
    ``off_policy_rollouts="correct"``, those at most ``max_staleness`` versions behind."""
    kept: list[ScoredRollout] = []
    off_policy = stale = dropped = 0
    lags = []
    for item in scored:
        lag = rollout_lag(item.transitions, dispatch_versions.get(item.attempt.rollout_id, current_version),
                          current_version)
        lags.append(lag)
        if lag > 0:
            off_policy += 1
        if lag > max_staleness:
            stale += 1
        elif lag > 0 and off_policy_rollouts == "drop":
            dropped += 1
        else:
            kept.append(item)
    return StalenessReport(kept, off_policy, stale, dropped, sum(lags) / len(lags) if lags else 0.0)


class AsyncTrainingLoop(TrainingLoop):
    """``TrainingLoop`` whose steps take finished groups instead of waiting for a whole round."""

    def __init__(self, settings: LoopSettings) -> None:
        super().__init__(settings)
        self.dispatcher: GroupDispatcher = GroupDispatcher(settings.rollout_timeout_s,
                                                            tuple(settings.hidden_task_fields),
                                                            settings.relaunch_attempts)
        self._relaunched_before: Counter = Counter()  # the dispatcher's relaunches up to the last step
        self._assembled: dict[str, AssembledRollout] = {}  # rollouts read from the store whose group is not trained yet
        self._collecting: set[str] = set()  # the rollouts of the groups this step took

    def new_rollouts(self) -> list[AssembledRollout]:
        """Rollouts of the groups in flight or being collected: those read before and those the
        store completed since (the synchronous loop would skip the ones of other groups)."""
        for rollout in super().new_rollouts():
            if rollout.rollout_id in self._collecting or self.dispatcher.knows(rollout.rollout_id):
                self._assembled[rollout.rollout_id] = rollout
        return list(self._assembled.values())

    def collect(self, attempts: list[Attempt], outcomes: dict[str, Outcome], held_out: bool = False) -> StepReport:
        """``TrainingLoop.collect`` of groups taken from the dispatcher (training or validation)."""
        self._collecting = {a.rollout_id for a in attempts}
        try:
            return super().collect(attempts, outcomes, held_out)
        finally:
            for attempt in attempts:
                self._assembled.pop(attempt.rollout_id, None)
            self._collecting = set()

    def run_step(self, step: int, backend: PolicyBackend,
                 on_wait: Callable[[int, int], None] | None = None,
                 on_idle: Callable[[float, int], None] | None = None) -> dict:
        """One update on the first ``tasks_per_step`` groups to finish; its metrics row."""
        settings = self.settings
        started = time.monotonic()
        capacity = settings.tasks_per_step * (1 + settings.max_staleness)
        missing = groups_to_open(capacity, self.dispatcher.groups_in_flight, self.dispatcher.versions_running(),
                                 backend.policy_version, settings.max_staleness)
        if missing > 0:
            self.dispatcher.add_groups(step, self.next_tasks(missing), settings.group_size, backend.policy_version)
        groups = self.dispatcher.take_finished_groups(settings.tasks_per_step, on_wait=on_wait, on_idle=on_idle,
                                                      idle_after_s=settings.runner_wait_warn_s)
        attempts = [a for g in groups for a in g.attempts]
        outcomes = {k: v for g in groups for k, v in g.outcomes.items()}
        report = self.collect(attempts, outcomes)
        versions = {a.rollout_id: g.dispatched_at_version for g in groups for a in g.attempts}
        staleness = filter_stale(report.scored, versions, backend.policy_version, settings.max_staleness,
                                 settings.off_policy_rollouts)
        left_out = report.left_out.copy()
        if staleness.stale_dropped:
            left_out["stale"] += staleness.stale_dropped
        if staleness.off_policy_dropped:
            left_out["off_policy"] += staleness.off_policy_dropped
        rollout_seconds = time.monotonic() - started
        row = self.train_on(step, backend, attempts, StepReport(staleness.kept, left_out, report.receiver_counters),
                           rollout_seconds, started)
        scores = [item.score for item in report.scored]  # what the agents scored, stale ones included
        row.update({
            keys.REWARD_MEAN: sum(scores) / len(scores) if scores else 0.0,
            # groups often finished before the step asked: the rate is over the whole step
            keys.ROLLOUTS_PER_S: len(attempts) / max(row[keys.STEP_SECONDS], 1e-9),
            keys.ROLLOUTS_OFF_POLICY: staleness.off_policy,
            keys.POLICY_LAG_MEAN: staleness.lag_mean,
            keys.GROUPS_IN_FLIGHT: self.dispatcher.groups_in_flight,
        })
        relaunched = self.dispatcher.relaunched()
        row[keys.ROLLOUTS_RELAUNCHED] = dict(relaunched - self._relaunched_before)  # in this step's wait
        self._relaunched_before = relaunched
        return row
