"""One ``spanrl train`` session: start-up, the steps, shut-down, for training and ``--val-only``.

``run_training`` checks what can be checked before waiting (a missing model, a taken port, a
backend that cannot start here), refuses to mix a new run into an old one, runs the warm start,
then ``start_session`` starts what both kinds of session need, each stopped again at the end
whatever happens: the backend (``backend.make_backend`` with ``TrainSettings.backend_run``), the
bridge's task API for runners and the dispatcher behind it. ``run_steps`` then runs the loop's
steps (``training_loop`` or ``async_training``) with validation rounds, metrics, the plot and the
trackers; with ``algorithm: apo``, ``run_prompt_search`` runs the prompt search (``apo/``,
weights frozen) instead, or before the steps with ``apo.then_grpo``; ``run_validation_only``
runs one validation round instead. Called by ``train_cli``,
``spanrl demo``, ``examples/sql_agent/pipeline.py`` and ``bench/``; ``spanrl eval``
(``evaluation.py``) starts its session with ``check_start`` and ``start_session`` too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass

from spanrl.errors import UserError
from spanrl.schema import metrics as keys

from . import warm_start
from .backend import PolicyBackend, check_backend, make_backend
from .bridge_api import BridgeAPI, PolicyInfo
from .empty_steps import NothingToTrain, empty_step_reason
from .metrics import MetricsLog
from .start_checks import check_before_start, wait_for_receiver
from .train_settings import TrainSettings
from .training_loop import TrainingLoop
from .validation import RESULT_FILE, ValidationResult, Validator, append_round

logger = logging.getLogger(__name__)


@dataclass
class Session:
    """What a started session holds: the backend serving the policy and the task API's URL."""

    backend: PolicyBackend
    api_url: str

    def waiting_for_runners(self, idle_s: float, unclaimed: int) -> None:
        logger.warning("waiting for runners: no runner has claimed a task for %.0f s (%d attempts wait); "
                       "start `spanrl run RUN.yaml` with bridge_url: %s", idle_s, unclaimed, self.api_url)


def start_session(settings: TrainSettings, loop: TrainingLoop, cleanup: ExitStack,
                  backend: PolicyBackend | None = None) -> Session:
    """Start the backend (unless one is given: ``spanrl eval --endpoint``) and the task API over
    ``loop``'s dispatcher; ``cleanup`` stops them."""
    # The task API's port is bound first and held while the backend starts (minutes for verl):
    # nothing the backend starts can take it meanwhile; runners are refused until it listens.
    api = BridgeAPI(loop.dispatcher, None, lambda: started.policy_version, settings.bridge_host,
                    settings.bridge_port, settings.bridge_token, tls_cert=settings.tls_cert, tls_key=settings.tls_key)
    try:
        started = backend if backend is not None else make_backend(settings.backend, settings.backend_run())
    except BaseException:
        api.stop()
        raise
    cleanup.callback(started.close)
    api.start(PolicyInfo(started.endpoint_url, settings.policy_model_name))
    cleanup.callback(api.stop)
    cleanup.callback(time.sleep, 1.0)  # runners hear "training finished" (410) before the API goes away
    cleanup.callback(loop.dispatcher.close)
    logger.info("policy endpoint %s, task API %s (give it to `spanrl run` as bridge_url), output %s",
                started.endpoint_url, api.url, settings.output_dir)
    return Session(started, api.url)


def check_start(settings: TrainSettings) -> None:
    """What is said before any waiting: a missing model, a taken port, a backend that cannot start."""
    check_before_start(settings)
    check_backend(settings.backend, settings.backend_run())  # e.g. verl not installed


def prepare_output(settings: TrainSettings) -> None:
    """A new run never mixes with an old one in the same folder; a resumed run continues it."""
    if settings.resume:
        return
    old = [p for p in (os.path.join(settings.output_dir, "metrics.jsonl"), settings.checkpoint_dir)
           if os.path.exists(p) and (os.path.isfile(p) or os.listdir(p))]
    if old:
        raise UserError(f"output_dir {settings.output_dir!r} already holds a training run "
                        f"({', '.join(old)}); pass --resume to continue it, or choose another --output-dir")


def warm_start_before_training(settings: TrainSettings, progress: bool = True) -> TrainSettings:
    """``settings`` to train with after the ``warm_start:`` block ran: ``model`` is then the warm
    model in ``<output_dir>/warm-start``. Nothing to do without the block, or when resuming a run
    that has checkpoints (they hold the warm start) or a finished warm start."""
    config = settings.warm_start
    if not config.enabled:
        return settings
    out_dir = os.path.join(settings.output_dir, "warm-start")
    checkpoints = settings.checkpoint_dir
    if settings.resume and os.path.isdir(checkpoints) and os.listdir(checkpoints):
        return settings
    if settings.resume and os.path.isfile(os.path.join(out_dir, warm_start.RECORD_FILE)):
        logger.info("resuming: the warm start in %s is done", out_dir)
        return dataclasses.replace(settings, model=out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    print(f"warm start: {config.steps} SFT steps on {warm_start.describe_sources(config)}", flush=True)
    record = warm_start.warm_start_model(config, settings.model, out_dir, progress=progress)
    print(f"warm start: loss {record['loss_first']:.3f} -> {record['loss_last']:.3f} in {record['seconds']:.0f} s "
          f"-> {out_dir}", flush=True)
    return dataclasses.replace(settings, model=out_dir)


def new_loop(settings: TrainSettings) -> TrainingLoop:
    if settings.from_traffic:  # served traffic and its late feedback, no tasks (traffic_loop.py)
        from .traffic_loop import TrafficLoop

        return TrafficLoop(settings)  # type: ignore[return-value]  # the steps' interface: run_step, dispatcher
    if settings.async_training:
        from .async_training import AsyncTrainingLoop

        return AsyncTrainingLoop(settings)
    return TrainingLoop(settings)


def run_training(settings: TrainSettings, show_progress: bool = True) -> dict:
    """Run ``spanrl train``: returns a summary (first/last reward, versions, paths)."""
    from .trackers import flat_config, open_trackers

    if settings.val_only:
        return {"validation": run_validation_only(settings)}
    check_start(settings)
    prepare_output(settings)
    settings = warm_start_before_training(settings, progress=show_progress)  # model: the warm one
    loop = new_loop(settings)
    validator = Validator(settings) if settings.val_tasks else None
    wait_for_receiver(settings.store, settings.receiver_wait_s)
    with ExitStack() as cleanup:  # whatever started is stopped, also when start-up fails
        trackers = open_trackers(settings.report_to, settings.output_dir, flat_config(settings),
                                 settings.tracking_project)
        cleanup.callback(trackers.close)
        session = start_session(settings, loop, cleanup)
        metrics = MetricsLog(settings.output_dir)
        # A resumed run continues from its checkpoint: later rows of metrics.jsonl are redone.
        metrics.keep_up_to_version(session.backend.policy_version)
        apo = run_prompt_search(settings, loop, session, metrics, trackers.log) if settings.algorithm == "apo" else None
        if apo is not None and not settings.apo.then_grpo:  # weights frozen: no checkpoint to save
            return {**training_summary(metrics, session.backend.policy_version, "", "", trackers.locations), **apo}
        run_steps(settings, loop, session, validator, metrics, trackers.log, show_progress,
                  last_step=len(metrics.rows) + settings.steps if apo is not None else None)
        final_checkpoint = session.backend.save_checkpoint(settings.checkpoint_dir)
    return {**training_summary(metrics, session.backend.policy_version, str(final_checkpoint),
                               settings.checkpoint_dir, trackers.locations), **(apo or {}),
            "tasks_without_signal": loop.task_scores.without_signal()}


def run_prompt_search(settings: TrainSettings, loop: TrainingLoop, session: Session, metrics: MetricsLog,
                      log_row: Callable[[dict], None]) -> dict:
    """``algorithm: apo``: the prompt search (``apo/run.py``), each round a metrics row; afterwards the
    endpoint serves the best prompts. Returns what the summary adds: the best prompt of each resource."""
    from .apo.run import PROMPTS_FILE, run_apo

    def append(row: dict) -> None:
        metrics.append(row)
        metrics.plot()
        log_row(row)

    results = run_apo(settings, loop, session.backend.endpoint_url, lambda: session.backend.policy_version, append,
                      on_idle=session.waiting_for_runners, first_row=len(metrics.rows))
    return {"prompts": os.path.join(settings.output_dir, PROMPTS_FILE),
            "best_prompts": {r.resource: {"candidate": r.best.name, "text": r.best.text, "score": r.best_score}
                             for r in results}}


def run_steps(settings: TrainSettings, loop: TrainingLoop, session: Session, validator: Validator | None,
              metrics: MetricsLog, log_row: Callable[[dict], None], show_progress: bool,
              last_step: int | None = None) -> None:
    """The steps after those ``metrics`` already holds, until ``last_step`` (default ``steps``; after
    APO's rounds, ``steps`` more) or ``stop_at_reward``."""
    from spanrl.progress import progress_bar

    backend = session.backend
    first_step = len(metrics.rows)
    last_step = settings.steps if last_step is None else last_step
    # a bar on a terminal, plain lines in a log
    with progress_bar(last_step, "spanrl train", unit="step", initial=first_step,
                      disable=not show_progress) as bar:
        empty = EmptySteps(settings.max_empty_steps)
        good_steps = 0
        for step in range(first_step, last_step):
            row = loop.run_step(step, backend, on_idle=session.waiting_for_runners,
                                on_wait=lambda done, total: bar.set_postfix_str(f"rollouts {done}/{total}"))
            if validator is not None and validator.due(step):  # held-out score: never trained on
                result = validator.run(loop, step + 1, backend, on_idle=session.waiting_for_runners)
                append_round(settings.output_dir, result)
                row.update(result.as_metrics())
            metrics.append(row)
            metrics.plot()
            log_row(row)
            if row[keys.ROLLOUTS_LEFT_OUT]:
                logger.warning("step %d left out rollouts: %s", step + 1, row[keys.ROLLOUTS_LEFT_OUT])
            empty.check(row)
            say_groups_without_signal(row)
            bar.update(1)
            bar.set_postfix(reward=f"{row[keys.REWARD_MEAN]:.2f}", version=backend.policy_version,
                            rps=f"{row[keys.ROLLOUTS_PER_S]:.1f}")
            reached = settings.stop_at_reward is not None and row[keys.REWARD_MEAN] >= settings.stop_at_reward
            good_steps = good_steps + 1 if reached else 0
            if good_steps >= 2:
                logger.info("reward_mean reached %.2f for 2 steps: stopping", settings.stop_at_reward)
                break


def say_groups_without_signal(row: dict) -> None:
    """Log the step's task groups whose rollouts all scored the same (GRPO's advantage is 0 there;
    a task no rollout solves step after step is one the policy cannot reach by sampling)."""
    flat = row.get(keys.GROUPS_WITHOUT_SIGNAL)
    if flat:
        scores = ", ".join(f"{count} all {score}" for score, count in sorted(flat.items()))
        logger.info("step %d: %d of %d task groups scored the same in every rollout (%s): nothing to compare there",
                    row[keys.STEP], sum(flat.values()), row.get(keys.GROUPS, 0), scores)


class EmptySteps:
    """Counts steps in a row that trained on nothing; ``NothingToTrain`` at ``max_empty_steps``."""

    def __init__(self, max_empty_steps: int) -> None:
        self.max_empty_steps = max_empty_steps
        self.in_a_row = 0

    def check(self, row: dict) -> None:
        reason = empty_step_reason(row)
        self.in_a_row = self.in_a_row + 1 if reason else 0
        if reason:
            logger.warning("%s", reason)
            if self.max_empty_steps and self.in_a_row >= self.max_empty_steps:
                raise NothingToTrain(f"stopped: {self.in_a_row} steps in a row trained on nothing "
                                     f"(max_empty_steps); the last: {reason}")


def training_summary(metrics: MetricsLog, policy_version: int, checkpoint: str, checkpoints: str,
                     trackers: dict) -> dict:
    """What ``run_training`` returns: first/last/best reward, versions, where the results are."""
    rewards = [r[keys.REWARD_MEAN] for r in metrics.rows]
    best = max(metrics.rows, key=lambda r: r[keys.REWARD_MEAN], default=None)
    return {
        "steps": len(metrics.rows),
        "first_reward": rewards[0] if rewards else None,
        "last_reward": rewards[-1] if rewards else None,
        "best_reward": None if best is None else best[keys.REWARD_MEAN],
        "best_step": None if best is None else best[keys.STEP],
        "policy_version": policy_version,
        "metrics": metrics.path,
        "plot": metrics.plot_path,
        "checkpoint": checkpoint,
        "checkpoints": checkpoints,
        "trackers": trackers,
    }


def run_validation_only(settings: TrainSettings) -> ValidationResult:
    """``spanrl train --val-only``: score ``val_tasks`` once with the policy the backend loads
    (``model``, or the newest checkpoint under ``output_dir`` with ``resume``) and write
    ``output_dir/validation.json``."""
    check_start(settings)
    loop = TrainingLoop(settings)
    validator = Validator(settings)
    wait_for_receiver(settings.store, settings.receiver_wait_s)
    with ExitStack() as cleanup:
        session = start_session(settings, loop, cleanup)
        backend = session.backend
        result = validator.run(loop, backend.policy_version, backend, on_idle=session.waiting_for_runners)
    os.makedirs(settings.output_dir, exist_ok=True)
    with open(os.path.join(settings.output_dir, RESULT_FILE), "w", encoding="utf-8") as f:
        json.dump({**asdict(result), "model": settings.model, "val_tasks": settings.val_tasks}, f, indent=2)
    return result
