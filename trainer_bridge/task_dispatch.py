"""Hands out the attempts of one training round and records how each one ended.

The bridge opens a round (tasks x group size attempts), runners claim attempts over HTTP
(``bridge_api``; the protocol is ``spanrl.bridge_protocol``), run the agent and report the
outcome; the bridge waits for the round to close. A claimed attempt whose runner never
reports back within the rollout timeout is counted as ``lost``: a crashed runner never stalls
training. Stdlib only.

Relaunch (``relaunch_attempts``): an attempt that ends as an infrastructure fault
(``is_infrastructure_fault``: lost with its runner, timed out, or failed by the runner itself,
``runner error: ...``) is replaced by a fresh attempt of the same task, same attempt number and
group, up to ``relaunch_attempts`` times, so that slow or unlucky tasks keep whole groups instead of
dropping out of training. An agent that ran and failed is the agent's failure: not relaunched.
Each relaunch is counted by reason (``relaunched``) and logged; the last fault of an attempt that
used up its relaunches is its outcome (left out with that reason, as without relaunch).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from spanrl.bridge_protocol import (
    REPORTABLE_STATUSES,
    TRAINING_ROLLOUT_PREFIX,
    Attempt,
    TrainingFinished,
    new_rollout_id,
)
from spanrl.errors import UserError
from spanrl.schema.tasks import Task

logger = logging.getLogger(__name__)

# A runner reports one of REPORTABLE_STATUSES; "lost" is the bridge's own verdict on an attempt
# whose runner never reported back.
STATUS_LOST = "lost"
OUTCOMES = (*REPORTABLE_STATUSES, STATUS_LOST)
# A runner's own failure (it could not run the agent at all): its error starts with this.
RUNNER_ERROR_PREFIX = "runner error"

__all__ = ["OUTCOMES", "STATUS_LOST", "Attempt", "Outcome", "TaskDispatcher", "TrainingFinished",
           "check_hidden_task_fields", "is_infrastructure_fault"]


@dataclass(frozen=True)
class Outcome:
    status: str  # one of OUTCOMES
    error: str | None = None
    seconds: float | None = None


@dataclass
class _Round:
    step: int
    attempts: dict[str, Attempt]
    opened_at: float = field(default_factory=time.monotonic)
    unclaimed: deque = field(default_factory=deque)
    claimed_at: dict[str, float] = field(default_factory=dict)
    by_claim_id: dict[str, str] = field(default_factory=dict)  # a runner's claim id -> rollout id
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    relaunches: dict[str, int] = field(default_factory=dict)  # rollout id -> relaunches before it
    relaunched: Counter = field(default_factory=Counter)  # reason (the fault's status) -> relaunches
    retired: set = field(default_factory=set)  # relaunched attempts: a late report of one is ignored


def is_infrastructure_fault(outcome: Outcome) -> bool:
    """Whether ``outcome`` is a fault of the machinery rather than of the agent (module docstring)."""
    if outcome.status in (STATUS_LOST, "timeout"):
        return True
    return outcome.status == "failed" and (outcome.error or "").startswith(RUNNER_ERROR_PREFIX)


def check_hidden_task_fields(hidden: Sequence[str], tasks: Sequence[Task], path: str) -> None:
    """A hidden field no task has is a typo that would hand the agent the field it should not see;
    the task id names every rollout (its spans, the runner's variables), so it cannot be hidden."""
    named_id = [name for name in hidden if name in ("id", "task_id")]
    if named_id:
        raise UserError(f"hidden_task_fields cannot hide {named_id}: the task id travels with every rollout")
    unknown = [name for name in hidden if not any(name in task.task for task in tasks)]
    if unknown:
        raise UserError(f"hidden_task_fields names {unknown}, which no task in {path} has; "
                        f"check the spelling (the fields of the first task: {sorted(tasks[0].task)})")


class TaskDispatcher:
    """Thread-safe queue of attempts; one round open at a time. Attempts keep the whole task (the
    reward function gets it); ``claim`` hands runners the task without ``hidden_task_fields``."""

    def __init__(self, rollout_timeout_s: float, hidden_task_fields: tuple[str, ...] = (),
                 relaunch_attempts: int = 0) -> None:
        self.rollout_timeout_s = rollout_timeout_s
        self.relaunch_attempts = relaunch_attempts
        self.hidden_task_fields = tuple(hidden_task_fields)
        self._lock = threading.Condition()
        self._round: _Round | None = None
        self._finished = False
        self._last_claim_at: float | None = None  # any round: runners were there then

    def open_round(self, step: int, tasks: Sequence[Task], group_size: int,
                   prefix: str = TRAINING_ROLLOUT_PREFIX,
                   before_open: Callable[[list[Attempt]], None] | None = None) -> list[Attempt]:
        """Queue ``group_size`` attempts of each ``(task_id, task)``; returns them, in task order.
        Their rollout ids start with ``prefix`` and the step (``v`` marks validation rounds).
        ``before_open(attempts)`` runs before any runner can claim one (APO tells the endpoint
        which prompt candidate each rollout gets)."""
        attempts = {}
        for task_id, task in tasks:
            for attempt in range(group_size):
                rollout_id = new_rollout_id(prefix, step, task_id, attempt)
                attempts[rollout_id] = Attempt(rollout_id, task_id, attempt, task, step)
        if before_open is not None:
            before_open(list(attempts.values()))
        with self._lock:
            self._round = _Round(step, attempts, unclaimed=deque(attempts))
            self._lock.notify_all()
        return list(attempts.values())

    def claim(self, claim_id: str | None = None) -> Attempt | None:
        """The next unclaimed attempt, or None when there is none right now. A ``claim_id``
        seen before in this round gets the same attempt again (a runner's retry)."""
        with self._lock:
            if self._finished:
                raise TrainingFinished()
            current = self._round
            if current is None:
                return None
            if claim_id is not None and claim_id in current.by_claim_id:
                return self._as_agent_sees_it(current.attempts[current.by_claim_id[claim_id]])
            if not current.unclaimed:
                return None
            rollout_id = current.unclaimed.popleft()
            current.claimed_at[rollout_id] = self._last_claim_at = time.monotonic()
            if claim_id is not None:
                current.by_claim_id[claim_id] = rollout_id
            return self._as_agent_sees_it(current.attempts[rollout_id])

    def _as_agent_sees_it(self, attempt: Attempt) -> Attempt:
        """``attempt`` with its task stripped of the hidden fields (what leaves this process)."""
        if not self.hidden_task_fields:
            return attempt
        visible = {k: v for k, v in attempt.task.items() if k not in self.hidden_task_fields}
        return dataclasses.replace(attempt, task=visible)

    def finish(self, rollout_id: str, status: str, error: str | None = None) -> bool:
        """Record a runner's report; False when the rollout is not part of the open round.
        Idempotent: a repeated report (a runner's retry) is accepted and the first one counts."""
        if status not in REPORTABLE_STATUSES:
            raise ValueError(f"status must be one of {REPORTABLE_STATUSES}, got {status!r}")
        with self._lock:
            current = self._round
            if current is not None and rollout_id in current.retired:
                return True
            if current is None or rollout_id not in current.attempts:
                return False
            if rollout_id not in current.outcomes:
                started = current.claimed_at.get(rollout_id)
                seconds = time.monotonic() - started if started is not None else None
                self._ended(current, rollout_id, Outcome(status, error, seconds))
                self._lock.notify_all()
            return True

    def _ended(self, current: _Round, rollout_id: str, outcome: Outcome) -> None:
        """Record ``outcome``, or relaunch the attempt when it is an infrastructure fault with
        relaunches left (under the lock). The ended attempt is retired (a late report of it is
        accepted and ignored); its replacement takes its place in the round."""
        done = current.relaunches.get(rollout_id, 0)
        if not is_infrastructure_fault(outcome) or done >= self.relaunch_attempts:
            current.outcomes[rollout_id] = outcome
            if done and outcome.status != "ok":
                logger.warning("attempt %d of task %s left out as %s after %d relaunch(es): %s",
                               current.attempts[rollout_id].attempt, current.attempts[rollout_id].task_id,
                               outcome.status, done, outcome.error)
            return
        old = current.attempts[rollout_id]
        new = dataclasses.replace(old, rollout_id=new_rollout_id(_prefix_of(old), old.step, old.task_id, old.attempt))
        current.attempts = {(new.rollout_id if k == rollout_id else k): (new if k == rollout_id else v)
                            for k, v in current.attempts.items()}
        current.relaunches[new.rollout_id] = done + 1
        current.relaunched[outcome.status] += 1
        current.claimed_at.pop(rollout_id, None)
        current.retired.add(rollout_id)
        current.by_claim_id = {c: r for c, r in current.by_claim_id.items() if r != rollout_id}
        current.unclaimed.appendleft(new.rollout_id)  # the oldest work of the round: claimed first
        self._replaced(rollout_id, new.rollout_id)
        logger.info("relaunching attempt %d of task %s (%s: %s) as %s", old.attempt, old.task_id, outcome.status,
                    outcome.error, new.rollout_id)

    def _replaced(self, old_id: str, new_id: str) -> None:
        """Hook: attempt ``old_id`` was relaunched as ``new_id`` (under the lock)."""

    def run_round(self, step: int, tasks: Sequence[Task], group_size: int, prefix: str,
                  on_idle: Callable[[float, int], None] | None = None,
                  idle_after_s: float = 0.0) -> tuple[list[Attempt], dict[str, Outcome]]:
        """Open a round, wait for it to close; its attempts (relaunched ones replaced) and outcomes.
        What validation rounds and ``spanrl eval`` run (``validation.score_round``)."""
        self.open_round(step, tasks, group_size, prefix=prefix)
        outcomes = self.wait_round(on_idle=on_idle, idle_after_s=idle_after_s)
        return self.round_attempts(), outcomes

    def round_attempts(self) -> list[Attempt]:
        """The open round's attempts as they stand (relaunched ones replaced), in task order."""
        with self._lock:
            return list(self._round.attempts.values()) if self._round is not None else []

    def relaunched(self) -> Counter:
        """The open round's relaunches so far, by reason."""
        with self._lock:
            return Counter(self._round.relaunched) if self._round is not None else Counter()

    def wait_round(self, poll_s: float = 0.5, on_wait: Callable[[int, int], None] | None = None,
                   on_idle: Callable[[float, int], None] | None = None,
                   idle_after_s: float = 30.0) -> dict[str, Outcome]:
        """Block until every attempt of the open round ended (or was lost); its outcomes.

        While attempts wait and no runner claimed one for ``idle_after_s`` (0 = never say it),
        ``on_idle(seconds_without_a_claim, unclaimed)`` is called, again every ``idle_after_s``;
        without ``on_idle`` that is a warning in the log."""
        with self._lock:
            current = self._round
            assert current is not None, "no round is open"
            said_at = current.opened_at
            while len(current.outcomes) < len(current.attempts):
                self._expire_lost(current)
                now = time.monotonic()
                quiet_since = max(current.opened_at, self._last_claim_at or 0.0, said_at)
                if idle_after_s > 0 and current.unclaimed and now - quiet_since >= idle_after_s:
                    said_at = now
                    idle = now - max(current.opened_at, self._last_claim_at or 0.0)
                    if on_idle is not None:
                        on_idle(idle, len(current.unclaimed))
                    else:
                        logger.warning("%d attempts of step %d wait: no runner claimed one for %.0f s; is "
                                       "`spanrl run` running and pointed at this bridge?",
                                       len(current.unclaimed), current.step, idle)
                if len(current.outcomes) >= len(current.attempts):
                    break
                if on_wait is not None:
                    on_wait(len(current.outcomes), len(current.attempts))
                self._lock.wait(poll_s)
            return dict(current.outcomes)

    def _expire_lost(self, current: _Round) -> None:
        # A grace of 10 s beyond the rollout timeout: the runner enforces the timeout itself
        # and reports it; this only catches runners that died.
        deadline = self.rollout_timeout_s + 10.0
        now = time.monotonic()
        expired: list[tuple[str, Outcome]] = []
        for rollout_id, started in current.claimed_at.items():
            if rollout_id not in current.outcomes and now - started > deadline:
                expired.append((rollout_id, Outcome(
                    STATUS_LOST, f"no report from the runner within {deadline:.0f} s", now - started)))
        for rollout_id, outcome in expired:
            self._ended(current, rollout_id, outcome)

    def close(self) -> None:
        with self._lock:
            self._finished = True
            self._lock.notify_all()


def _prefix_of(attempt: Attempt) -> str:
    """The rollout-id prefix ``attempt``'s round used (the text before its step number)."""
    head = f"{attempt.step}-{attempt.task_id}-a{attempt.attempt}-"
    index = attempt.rollout_id.rfind(head)
    return attempt.rollout_id[:index] if index >= 0 else TRAINING_ROLLOUT_PREFIX
