"""The trainer bridge's loop: hand out tasks, collect rollouts from the store, GRPO, publish.

One step: open a round of ``tasks_per_step`` tasks x ``group_size`` attempts for runners;
wait until every attempt is reported (ok, failed, timed out, or lost with its runner); read
the assembled rollouts of the ok attempts from the receiver's store; score them (the agent's
reward events or the configured reward function); turn every usable transition into a
training sample with its group advantage; hand the samples to the backend
(``backend.PolicyBackend.update``), which trains and publishes the new policy at the same URL.
Rollouts that failed, timed out, never assembled, carry no usable transition or whose reward
function raised are counted in the metrics (``rollouts_left_out``) and never trained on.
Called by ``spanrl train`` (``train_cli``) and ``spanrl demo``; which backend runs is decided
by ``backend.make_backend`` alone.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spanrl.errors import UserError
from spanrl.otlp_receiver import trained_rewards

from .backend import PolicyBackend, TrainingSample, check_backend, make_backend
from .empty_steps import NothingToTrain, empty_step_reason
from .rejection_sampling import sft_samples, sft_update
from .samples import trained_rollout, training_samples
from .task_dispatch import Attempt, Outcome, TaskDispatcher, check_hidden_task_fields, task_id_of
from .train_settings import TrainSettings
from .trajectory_merge import update_rows

logger = logging.getLogger(__name__)

STORE_POLL_S = 0.1


def load_tasks(path: str) -> list[tuple[str, dict]]:
    """``(task_id, task)`` pairs from a JSONL file; bad lines are named in the error."""
    tasks: list[tuple[str, dict]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    task = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path}:{number}: not JSON: {exc}") from exc
                if not isinstance(task, dict):
                    raise UserError(f"{path}:{number}: a task must be a JSON object")
                tasks.append((task_id_of(task, len(tasks)), task))
    except FileNotFoundError as exc:
        raise UserError(f"task file not found: {path}") from exc
    if not tasks:
        raise UserError(f"task file {path} holds no tasks")
    return tasks


def load_reward_function(spec: str, python_path: list) -> Callable[..., Any]:
    """The ``module:function`` reward, importable from ``python_path`` folders; it is called
    as ``reward(task, variables)`` and returns a number."""
    from spanrl.import_path import load_callable

    return load_callable(spec, python_path)


@dataclass(frozen=True)
class ScoredRollout:
    """An ok rollout with its score and the transitions to train on (the selected agents')."""

    attempt: Attempt
    score: float
    transitions: tuple  # of spanrl.otlp_receiver.transitions.Transition
    reward_source: str = ""  # shown by `spanrl inspect`: the reward function, or the events' sources


@dataclass
class StepReport:
    """What one step saw: usable rollouts and the reasons the others were left out."""

    scored: list[ScoredRollout]
    left_out: Counter
    # what the receiver's checks counted in the step's rollouts (Rollout.counters summed)
    receiver_counters: Counter = field(default_factory=Counter)


class TrainingLoop:
    """Tasks, rounds of attempts, and collecting and scoring their rollouts from the store."""

    def __init__(self, settings: TrainSettings) -> None:
        self.settings = settings
        self.tasks = load_tasks(settings.tasks)
        self.reward_fn = (
            None if settings.reward == "events"
            else load_reward_function(settings.reward, settings.python_path)
        )
        self.rng = random.Random(settings.seed)
        check_hidden_task_fields(settings.hidden_task_fields, self.tasks, settings.tasks)
        self.dispatcher = TaskDispatcher(settings.rollout_timeout_s, tuple(settings.hidden_task_fields))
        self._task_order: list[int] = []

        from spanrl.otlp_receiver.store import SpanStore

        self.store = SpanStore(settings.store)
        self.cursor = 0

    # --- rounds ----------------------------------------------------------------------------
    def next_tasks(self, count: int | None = None) -> list[tuple[str, dict]]:
        """``count`` (default ``tasks_per_step``) tasks, each epoch in a fresh random order."""
        chosen: list[tuple[str, dict]] = []
        while len(chosen) < (self.settings.tasks_per_step if count is None else count):
            if not self._task_order:
                self._task_order = list(range(len(self.tasks)))
                self.rng.shuffle(self._task_order)
            chosen.append(self.tasks[self._task_order.pop()])
        return chosen

    def collect(self, attempts: list[Attempt], outcomes: dict[str, Outcome]) -> StepReport:
        """Read the ok attempts' rollouts from the store and score them."""
        left_out: Counter = Counter()
        waiting = {}
        for attempt in attempts:
            outcome = outcomes.get(attempt.rollout_id)
            status = outcome.status if outcome else "lost"
            if status == "ok":
                waiting[attempt.rollout_id] = attempt
            else:
                left_out[status] += 1
        found: dict[str, Any] = {}
        deadline = time.monotonic() + self.settings.assembly_wait_s
        while waiting.keys() - found.keys():
            for rollout in self.new_rollouts():
                if rollout.rollout_id in waiting:
                    found[rollout.rollout_id] = rollout
            if not (waiting.keys() - found.keys()) or time.monotonic() > deadline:
                break
            time.sleep(STORE_POLL_S)
        if waiting.keys() - found.keys():
            left_out["unassembled"] += len(waiting.keys() - found.keys())
        scored = []
        receiver_counters: Counter = Counter()
        for rollout_id, rollout in found.items():
            attempt = waiting[rollout_id]
            receiver_counters.update(rollout.counters)
            if rollout.status != "ok":
                left_out["failed"] += 1
                continue
            if not rollout.transitions:
                left_out["no_transitions"] += 1
                continue
            # selective optimisation: only the named agents' calls are trained on
            transitions = tuple(
                t for t in rollout.transitions
                if not self.settings.agents or t.agent_name in self.settings.agents
            )
            if not transitions:
                left_out["no_selected_agent"] += 1
                continue
            try:
                score = self.score(attempt, rollout)
            except RewardFunctionError:
                left_out["reward_error"] += 1
                continue
            if score is None:
                left_out["no_reward"] += 1
                continue
            scored.append(ScoredRollout(attempt, score, transitions, self.reward_source(rollout)))
        return StepReport(scored, left_out, receiver_counters)

    def new_rollouts(self) -> list[Any]:
        """Rollouts the store completed since the last call."""
        rollouts, self.cursor = self.store.completed_rollouts(since=self.cursor)
        return list(rollouts)

    def reward_source(self, rollout: Any) -> str:
        if self.reward_fn is not None:
            return f"reward function {self.settings.reward}"
        return "events: " + ", ".join(sorted({r.source for r in rollout.rewards}))

    def score(self, attempt: Attempt, rollout: Any) -> float | None:
        """The rollout's score: its total reward (``reward: events``) or the reward function's
        value; ``None`` when there is none (no reward event, a non-finite value). Raises
        ``RewardFunctionError`` (logged, with the task id) when the reward function raised."""
        if self.reward_fn is None:
            total = rollout.total_reward if self.settings.trust_agent_rewards else rule_reward(rollout)
            return total if total is not None and math.isfinite(total) else None
        try:
            score = float(self.reward_fn(attempt.task, dict(rollout.variables)))
        except Exception as exc:  # a broken reward function must not kill training: skip the rollout
            logger.exception("reward function %s failed on task %s (rollout %s): rollout left out",
                             self.settings.reward, attempt.task_id, rollout.rollout_id)
            raise RewardFunctionError(f"reward function failed on task {attempt.task_id}") from exc
        if not math.isfinite(score):
            logger.warning("reward function gave %r for task %s (rollout %s): left out", score,
                           attempt.task_id, rollout.rollout_id)
            return None
        return score

    def run_step(self, step: int, backend: PolicyBackend,
                 on_wait: Callable[[int, int], None] | None = None,
                 on_idle: Callable[[float, int], None] | None = None) -> dict:
        """One training step: a round of attempts, their rollouts, one update; its metrics row.

        ``on_idle(seconds, unclaimed)`` is called when no runner claimed an attempt for
        ``runner_wait_warn_s``. A step with no usable sample makes no update (the policy
        version stays). The reward and returns each scored rollout was trained with are
        recorded in the store for ``spanrl inspect``."""
        started = time.monotonic()
        attempts = self.dispatcher.open_round(step, self.next_tasks(), self.settings.group_size)
        outcomes = self.dispatcher.wait_round(on_wait=on_wait, on_idle=on_idle,
                                              idle_after_s=self.settings.runner_wait_warn_s)
        report = self.collect(attempts, outcomes)
        return self.train_on(step, backend, attempts, report, time.monotonic() - started, started)

    def train_on(self, step: int, backend: PolicyBackend, attempts: list[Attempt], report: StepReport,
                 rollout_seconds: float, started: float) -> dict:
        """Samples of ``report``'s scored rollouts (merged into rows with ``merge_trajectories``),
        one update on them; the step's metrics row."""
        transition_returns = (self.settings.advantage_level == "transition" and self.reward_fn is None
                              and self.settings.trust_agent_rewards)  # returns include the agent's rewards
        rejected: set[str] = set()
        merge_metrics: dict = {}
        if self.settings.algorithm == "sft":  # rejection sampling: learn the good rollouts' calls (NLL)
            samples, rejected = sft_samples(report.scored, self.settings.sft_min_reward)
            dropped: set[str] = set()
            stats = sft_update(backend, samples) if samples else {}
            stats["rollouts_below_sft_min_reward"] = len(rejected)
        else:
            samples, dropped = training_samples(
                report.scored, self.settings.advantage_level, self.settings.norm_adv_by_std,
                transition_returns=transition_returns,
                loss_weighting=self.settings.loss_weighting,
            )
            rows, merge_metrics = update_rows(samples, self.settings.merge_trajectories)
            stats = backend.update(rows).as_metrics() if rows else {}
        try:
            trained_rewards.record(self.settings.store, [
                trained_rollout(step + 1, item, transition_returns, item.attempt.rollout_id not in dropped | rejected)
                for item in report.scored
            ])
        except sqlite3.Error as exc:  # what inspect shows must not stop training
            logger.warning("could not record the rewards of step %d in %s: %s", step + 1, self.settings.store, exc)
        return {**_step_row(step, backend.policy_version, attempts, report, samples, len(dropped), stats,
                            rollout_seconds, started), **merge_metrics}


class RewardFunctionError(Exception):
    """The configured reward function raised on a rollout (which is then left out)."""


AIR_SOURCE_PREFIX = "air:"  # Reward.source of a reward made by one of the receiver's AIR rules


def rule_reward(rollout: Any) -> float | None:
    """The sum of a rollout's AIR rule rewards (None when it has none): what counts when the
    agent's own reward events are not trusted."""
    values = [r.value for r in rollout.rewards if r.source.startswith(AIR_SOURCE_PREFIX)]
    return sum(values) if values else None


def _prepare_output(settings: TrainSettings, checkpoints: str) -> None:
    """A new run never mixes with an old one in the same folder; a resumed run continues it."""
    if settings.resume:
        return
    old = [p for p in (os.path.join(settings.output_dir, "metrics.jsonl"), checkpoints)
           if os.path.exists(p) and (os.path.isfile(p) or os.listdir(p))]
    if old:
        raise UserError(f"output_dir {settings.output_dir!r} already holds a training run "
                         f"({', '.join(old)}); pass --resume to continue it, or choose "
                         "another --output-dir")


def _step_row(step: int, policy_version: int, attempts: list[Attempt], report: StepReport,
              samples: list[TrainingSample], dropped: int, stats: dict, rollout_seconds: float,
              started: float) -> dict:
    """One line of metrics.jsonl."""
    scores = [s.score for s in report.scored]
    row = {
        "step": step + 1,  # updates done so far: step k published policy version k
        "reward_mean": sum(scores) / len(scores) if scores else 0.0,
        "policy_version": policy_version,
        "transitions": len(samples),
        "rollouts": len(attempts),
        "rollouts_used": len(report.scored) - dropped,
        "rollouts_left_out": dict(report.left_out),
        "receiver_counters": dict(report.receiver_counters),  # rewards clipped, rejected, replayed, ...
        "groups_of_one_dropped": dropped,
        "rollouts_per_s": len(attempts) / max(rollout_seconds, 1e-9),
        "rollout_seconds": rollout_seconds,  # waiting for the step's rollouts
        "seconds": time.monotonic() - started,
    }
    for key, value in stats.items():  # the update's own statistics (loss, kl, ...)
        key = "update_seconds" if key == "seconds" else key
        if key not in row and isinstance(value, (int, float)):
            row[key] = float(value)
    return row


def run_training(settings: TrainSettings, show_progress: bool = True) -> dict:
    """Run ``spanrl train``: returns a summary (first/last reward, versions, paths)."""
    from contextlib import ExitStack

    from tqdm import tqdm

    from .bridge_api import BridgeAPI, PolicyInfo
    from .metrics import MetricsLog
    from .start_checks import check_before_start, wait_for_receiver
    from .trackers import flat_config, open_trackers

    if settings.val_only:
        from .validation import run_validation_only

        return {"validation": run_validation_only(settings)}
    check_before_start(settings)
    check_backend(settings)  # e.g. verl not installed: say so before any waiting
    checkpoints = settings.trainer.checkpoint_dir or os.path.join(settings.output_dir, "checkpoints")
    _prepare_output(settings, checkpoints)
    from .warm_start import warm_start_before_training

    settings = warm_start_before_training(settings, progress=show_progress)  # model: the warm one
    if settings.async_training:
        from .async_training import AsyncTrainingLoop

        loop: TrainingLoop = AsyncTrainingLoop(settings)
    else:
        loop = TrainingLoop(settings)
    from .validation import Validator

    validator = Validator(settings) if settings.val_tasks else None
    wait_for_receiver(settings.store, settings.receiver_wait_s)
    with ExitStack() as cleanup:  # whatever started is stopped, also when start-up fails
        trackers = open_trackers(settings.report_to, settings.output_dir, flat_config(settings),
                                 settings.tracking_project)
        cleanup.callback(trackers.close)
        backend = make_backend(settings, checkpoints)
        cleanup.callback(backend.close)
        metrics = MetricsLog(settings.output_dir)
        # A resumed run continues from its checkpoint: later rows of metrics.jsonl are redone.
        metrics.keep_up_to_version(backend.policy_version)
        api = BridgeAPI(
            loop.dispatcher, PolicyInfo(backend.endpoint_url, settings.policy_model_name),
            lambda: backend.policy_version, settings.bridge_host, settings.bridge_port, settings.bridge_token,
        ).start()
        cleanup.callback(api.stop)
        # let runners hear "training finished" (410) before the API goes away
        cleanup.callback(time.sleep, 1.0)
        cleanup.callback(loop.dispatcher.close)
        logger.info("policy endpoint %s, task API %s (give it to `spanrl run` as bridge_url), output %s",
                    backend.endpoint_url, api.url, settings.output_dir)

        def waiting_for_runners(idle_s: float, unclaimed: int) -> None:
            logger.warning("waiting for runners: no runner has claimed a task for %.0f s (%d attempts wait); "
                           "start `spanrl run RUN.yaml` with bridge_url: %s", idle_s, unclaimed, api.url)

        first_step = len(metrics.rows)
        bar = tqdm(total=settings.steps, initial=first_step, disable=not show_progress,
                   desc="spanrl train", unit="step", dynamic_ncols=True)
        cleanup.callback(bar.close)
        good_steps = empty_steps = 0
        for step in range(first_step, settings.steps):
            row = loop.run_step(
                step, backend,
                on_wait=lambda done, total: bar.set_postfix_str(f"rollouts {done}/{total}"),
                on_idle=waiting_for_runners,
            )
            if validator is not None and validator.due(step):  # held-out score: never trained on
                row.update(validator.run(loop, step + 1, backend, on_idle=waiting_for_runners).as_metrics())
            metrics.append(row)
            metrics.plot()
            trackers.log(row)
            if row["rollouts_left_out"]:
                logger.warning("step %d left out rollouts: %s", step + 1, row["rollouts_left_out"])
            empty = empty_step_reason(row)
            empty_steps = empty_steps + 1 if empty else 0
            if empty:
                logger.warning("%s", empty)
                if settings.max_empty_steps and empty_steps >= settings.max_empty_steps:
                    raise NothingToTrain(f"stopped: {empty_steps} steps in a row trained on nothing "
                                         f"(max_empty_steps); the last: {empty}")
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", version=backend.policy_version,
                            rps=f"{row['rollouts_per_s']:.1f}")
            reached = settings.stop_at_reward is not None and row["reward_mean"] >= settings.stop_at_reward
            good_steps = good_steps + 1 if reached else 0
            if good_steps >= 2:
                logger.info("reward_mean reached %.2f for 2 steps: stopping", settings.stop_at_reward)
                break
        final_checkpoint = backend.save_checkpoint(checkpoints)
    rewards = [r["reward_mean"] for r in metrics.rows]
    best = max(metrics.rows, key=lambda r: r["reward_mean"], default=None)
    return {
        "steps": len(metrics.rows),
        "first_reward": rewards[0] if rewards else None,
        "last_reward": rewards[-1] if rewards else None,
        "best_reward": None if best is None else best["reward_mean"],
        "best_step": None if best is None else best["step"],
        "policy_version": backend.policy_version,
        "metrics": metrics.path,
        "plot": metrics.plot_path,
        "checkpoint": str(final_checkpoint),
        "checkpoints": checkpoints,
        "trackers": trackers.locations,
    }
