"""``spanrl train --from-traffic``: training steps on served traffic instead of rounds of tasks.

Picked by ``session.new_loop`` when ``from_traffic`` is set. No task list and no runner: agents
send real requests to the policy endpoint (``spanrl train``'s own, or the verl gateway), the
endpoint's spans reach the receiver, and feedback arrives when it arrives (docs/receiver.md
"Late feedback"). Each step waits (at most ``traffic_wait_s``) for ``tasks_per_step`` rollouts
of the window whose score is known (``traffic_window.TrafficWindow``), builds their samples
(``traffic_window.traffic_samples``: GRPO over rollouts with the same first prompt, else the
agent's running mean as baseline) and makes one update through the same path as every other
step (``trajectory_merge.update_rows``, ``backend.update``, ``training_loop.step_row``), and
records what each rollout was trained with (``trained_rewards``: ``spanrl inspect`` shows it, and
a resumed run does not train on those rollouts again).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections import Counter
from collections.abc import Callable

from spanrl.otlp_receiver import trained_rewards
from spanrl.schema import metrics as keys

from .backend import PolicyBackend
from .loop_settings import LoopSettings
from .samples import sample_advantages, trained_rollout
from .task_dispatch import TaskDispatcher
from .traffic_window import AgentBaselines, TrafficSettings, TrafficWindow, scored_traffic, traffic_samples
from .training_loop import STORE_POLL_S, StepReport, StepUpdate, step_row
from .trajectory_merge import update_rows

logger = logging.getLogger(__name__)


class TrafficLoop:
    """The steps of a ``from_traffic`` run; ``run_step`` has ``TrainingLoop.run_step``'s signature."""

    def __init__(self, settings: LoopSettings) -> None:
        self.settings = settings
        self.window = TrafficWindow(settings.store, TrafficSettings(
            settings.traffic_window, settings.traffic_max_age_s, settings.traffic_prefix_tokens,
            settings.traffic_baseline_decay))
        self.baselines = AgentBaselines(settings.traffic_baseline_decay)
        # the task API still runs (runners asking get nothing to do); no round is ever opened
        self.dispatcher = TaskDispatcher(settings.rollout_timeout_s, tuple(settings.hidden_task_fields))
        self._left_out_before: Counter = Counter()
        self.window.trained = set(trained_rewards.load(settings.store))  # a resumed run trains each once

    def run_step(self, step: int, backend: PolicyBackend,
                 on_wait: Callable[[int, int], None] | None = None,
                 on_idle: Callable[[float, int], None] | None = None) -> dict:
        """Wait for ``tasks_per_step`` judged rollouts (or ``traffic_wait_s``), then one update."""
        started = time.monotonic()
        wanted = self.settings.tasks_per_step
        while True:
            self.window.poll()
            ready = len(self.window.judged())
            if on_wait is not None:
                on_wait(ready, wanted)
            if ready >= wanted or time.monotonic() - started > self.settings.traffic_wait_s:
                break
            time.sleep(STORE_POLL_S)
        rollouts = self.window.take(wanted)
        waited = time.monotonic() - started
        samples, counts = traffic_samples(rollouts, self.baselines, step, self.settings.traffic_prefix_tokens,
                                          self.settings.norm_adv_by_std)
        rows, merge_metrics = update_rows(samples, self.settings.merge_trajectories)
        stats = backend.update(rows).as_metrics() if rows else {}
        left_out = self.window.left_out - self._left_out_before
        self._left_out_before = Counter(self.window.left_out)
        scored = scored_traffic(rollouts, step, self.settings.traffic_prefix_tokens)
        report = StepReport(scored, left_out, Counter())
        for rollout in rollouts:
            report.receiver_counters.update(rollout.counters)
        update = StepUpdate(samples, set(), 0, {**stats, **merge_metrics}, sample_advantages(samples))
        self._record(step, scored, update)
        row = step_row(step, backend.policy_version, [item.attempt for item in scored], report, update, waited,
                       started)
        row.update({keys.TRAFFIC_GROUPED: counts["grouped"],
                    keys.TRAFFIC_BY_AGENT_BASELINE: counts["by_agent_baseline"],
                    keys.TRAFFIC_WAITING: len(self.window.waiting)})
        return row

    def _record(self, step: int, scored: list, update: StepUpdate) -> None:
        """What each rollout was trained with, in the store (``spanrl inspect``; a resumed run skips them)."""
        try:
            trained_rewards.record(self.settings.store, [
                trained_rollout(step + 1, item, False, True, update.advantages) for item in scored])
        except sqlite3.Error as exc:  # what inspect shows must not stop training
            logger.warning("could not record the rewards of step %d in %s: %s", step + 1, self.settings.store, exc)

    def close(self) -> None:
        self.window.close()
