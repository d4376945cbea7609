"""The trainer bridge's loop: hand out tasks, collect rollouts from the store, GRPO, publish.

One step: open a round of ``tasks_per_step`` tasks x ``group_size`` attempts for runners;
wait until every attempt is reported (ok, failed, timed out, or lost with its runner); read
the assembled rollouts of the ok attempts from the receiver's store; score them (the agent's
reward events or the configured reward function); turn every usable transition into a
training sample with its group advantage; run one GRPO update; swap the new weights into the
embedded policy server, so agents keep calling the same URL and get the new policy.
Rollouts that failed, timed out, never assembled or carry no usable transition are counted
in the metrics and never trained on.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spanrl.errors import UserError

from .task_dispatch import Attempt, Outcome, TaskDispatcher, task_id_of
from .train_settings import TrainSettings

logger = logging.getLogger(__name__)

STORE_POLL_S = 0.1


def load_tasks(path: str) -> list[tuple[str, dict]]:
    """``(task_id, task)`` pairs from a JSONL file; bad lines are named in the error."""
    tasks = []
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


def load_reward_function(spec: str, python_path: list) -> Callable[[dict, dict], float]:
    for folder in python_path:
        if os.path.abspath(folder) not in sys.path:
            sys.path.insert(0, os.path.abspath(folder))
    from spanrl.import_path import load_callable

    return load_callable(spec)


@dataclass(frozen=True)
class ScoredRollout:
    attempt: Attempt
    score: float
    transitions: tuple  # of spanrl.otlp_receiver.transitions.Transition


@dataclass
class StepReport:
    """What one step saw: usable rollouts and the reasons the others were left out."""

    scored: list[ScoredRollout]
    left_out: Counter


class TrainingLoop:
    def __init__(self, settings: TrainSettings) -> None:
        self.settings = settings
        self.tasks = load_tasks(settings.tasks)
        self.reward_fn = (
            None if settings.reward == "events"
            else load_reward_function(settings.reward, settings.python_path)
        )
        self.rng = random.Random(settings.seed)
        self.dispatcher = TaskDispatcher(settings.rollout_timeout_s)
        self._task_order: list[int] = []

        from spanrl.otlp_receiver.store import SpanStore

        self.store = SpanStore(settings.store)
        self.cursor = 0

    # --- rounds ----------------------------------------------------------------------------
    def next_tasks(self) -> list[tuple[str, dict]]:
        """``tasks_per_step`` tasks, each epoch in a fresh random order."""
        chosen = []
        while len(chosen) < self.settings.tasks_per_step:
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
            rollouts, self.cursor = self.store.completed_rollouts(since=self.cursor)
            for rollout in rollouts:
                if rollout.rollout_id in waiting:
                    found[rollout.rollout_id] = rollout
            if not (waiting.keys() - found.keys()) or time.monotonic() > deadline:
                break
            time.sleep(STORE_POLL_S)
        if waiting.keys() - found.keys():
            left_out["unassembled"] += len(waiting.keys() - found.keys())
        scored = []
        for rollout_id, rollout in found.items():
            attempt = waiting[rollout_id]
            if rollout.status != "ok":
                left_out["failed"] += 1
                continue
            transitions = tuple(
                t for t in rollout.transitions
                if not self.settings.agents or t.agent_name in self.settings.agents
            )
            if not transitions:
                left_out["no_transitions"] += 1
                continue
            score = self.score(attempt, rollout)
            if score is None:
                left_out["no_reward"] += 1
                continue
            scored.append(ScoredRollout(attempt, score, transitions))
        return StepReport(scored, left_out)

    def score(self, attempt: Attempt, rollout: Any) -> float | None:
        if self.reward_fn is None:
            total = rollout.total_reward
            return total if total is not None and math.isfinite(total) else None
        try:
            score = float(self.reward_fn(attempt.task, dict(rollout.variables)))
        except Exception:  # a broken reward function must not kill training: skip the rollout
            logger.exception("reward function failed on rollout %s", rollout.rollout_id)
            return None
        if not math.isfinite(score):
            logger.warning("reward function gave %r for rollout %s: left out", score,
                           rollout.rollout_id)
            return None
        return score


def training_samples(scored: list[ScoredRollout], level: str, norm_adv_by_std: bool,
                     transition_returns: bool = False):
    """GRPO samples of all usable transitions, with their group advantages.

    ``transition_returns``: score each transition by its own credit-assigned return (reward
    events with ``level="transition"``) instead of its rollout's score.
    Returns ``(samples, dropped_rollouts)``: rollouts of a group of one are dropped.
    """
    from .grpo import group_advantages
    from .torch_backend.trainer import TrainingSample

    returns, groups, rollout_ids, transitions = [], [], [], []
    for item in scored:
        for transition in item.transitions:
            returns.append(transition.return_ if transition_returns else item.score)
            groups.append(item.attempt.task_id)
            rollout_ids.append(item.attempt.rollout_id)
            transitions.append(transition)
    if not transitions:
        return [], 0
    advantages, keep = group_advantages(
        returns, groups, rollout_ids, level=level,
        estimator="grpo" if norm_adv_by_std else "drgrpo",
    )
    samples = [
        TrainingSample(
            prompt_token_ids=list(t.prompt_token_ids),
            response_token_ids=list(t.response_token_ids),
            advantage=float(a),
            old_logprobs=None if t.response_logprobs is None else list(t.response_logprobs),
        )
        for t, a, k in zip(transitions, advantages, keep) if k and t.response_token_ids
    ]
    dropped = len({r for r, k in zip(rollout_ids, keep) if not k})
    return samples, dropped


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


def _start_trainer(settings: TrainSettings, checkpoints: str):
    """The torch trainer (resumed from the newest checkpoint with --resume) and the model
    directory the policy server should load."""
    from .torch_backend.trainer import TorchTrainer, list_checkpoints

    config = settings.trainer  # its checkpoint_dir is ``checkpoints``: see TrainSettings.__post_init__
    if settings.resume and list_checkpoints(checkpoints):
        trainer = TorchTrainer.resume(checkpoints, config)
        return trainer, str(list_checkpoints(checkpoints)[-1])
    return TorchTrainer(settings.model, config), settings.model


def _step_row(step: int, trainer, attempts, report: StepReport, samples, dropped: int,
              stats: dict, rollout_seconds: float, started: float) -> dict:
    """One line of metrics.jsonl."""
    scores = [s.score for s in report.scored]
    row = {
        "step": step + 1,  # updates done so far: step k published policy version k
        "reward_mean": sum(scores) / len(scores) if scores else 0.0,
        "policy_version": trainer.policy_version,
        "transitions": len(samples),
        "rollouts": len(attempts),
        "rollouts_used": len(report.scored) - dropped,
        "rollouts_left_out": dict(report.left_out),
        "groups_of_one_dropped": dropped,
        "rollouts_per_s": len(attempts) / max(rollout_seconds, 1e-9),
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
    from .torch_backend.engine.policy_engine import PolicyEngine
    from .torch_backend.server.api_process import serve_in_process

    if not os.path.isfile(os.path.join(settings.model, "config.json")):
        raise UserError(f"model {settings.model!r} is not a Hugging Face model directory "
                        "(no config.json); create one with `spanrl model init DIR`")
    checkpoints = settings.trainer.checkpoint_dir or os.path.join(settings.output_dir, "checkpoints")
    _prepare_output(settings, checkpoints)
    loop = TrainingLoop(settings)
    trainer, serving_dir = _start_trainer(settings, checkpoints)
    metrics = MetricsLog(settings.output_dir)
    # A resumed run continues from its checkpoint: later rows of metrics.jsonl are redone.
    metrics.keep_up_to_version(trainer.policy_version)
    if settings.engine.threads > 0:  # torch intra-op threads of this process (trainer and engine)
        import torch

        torch.set_num_threads(settings.engine.threads)
    with ExitStack() as cleanup:  # whatever started is stopped, also when start-up fails
        engine = PolicyEngine.from_pretrained(
            serving_dir, device=settings.engine.device, dtype=settings.engine.dtype,
            model_name=settings.policy_model_name, version=trainer.policy_version,
            max_batch_size=settings.engine.max_batch_size, batch_wait_s=settings.engine.batch_wait_ms / 1000.0,
        )
        # HTTP in its own process: agents' requests are not held up by this process's training steps
        try:
            server = serve_in_process(engine, settings.policy_host, settings.policy_port)
        except OSError as exc:  # a setting the user can change: said in one line by `spanrl train`
            raise UserError(f"the policy server cannot listen on {settings.policy_host}:"
                            f"{settings.policy_port} (policy_port): {exc}") from exc
        cleanup.callback(server.stop)
        api = BridgeAPI(
            loop.dispatcher, PolicyInfo(server.base_url, settings.policy_model_name),
            lambda: trainer.policy_version, settings.bridge_host, settings.bridge_port,
        ).start()
        cleanup.callback(api.stop)
        # let runners hear "training finished" (410) before the API goes away
        cleanup.callback(time.sleep, 1.0)
        cleanup.callback(loop.dispatcher.close)
        logger.info("policy endpoint %s, task API %s, output %s",
                    server.base_url, api.url, settings.output_dir)
        first_step = len(metrics.rows)
        bar = tqdm(total=settings.steps, initial=first_step, disable=not show_progress,
                   desc="spanrl train", unit="step", dynamic_ncols=True)
        cleanup.callback(bar.close)
        good_steps = 0
        for step in range(first_step, settings.steps):
            started = time.monotonic()
            attempts = loop.dispatcher.open_round(step, loop.next_tasks(), settings.group_size)
            outcomes = loop.dispatcher.wait_round(
                on_wait=lambda done, total: bar.set_postfix_str(f"rollouts {done}/{total}")
            )
            report = loop.collect(attempts, outcomes)
            rollout_seconds = time.monotonic() - started
            samples, dropped = training_samples(
                report.scored, settings.advantage_level, settings.norm_adv_by_std,
                transition_returns=settings.advantage_level == "transition" and loop.reward_fn is None,
            )
            stats = trainer.grpo_step(samples) if samples else {}
            if samples:
                engine.swap_weights(trainer.policy_state_dict(), trainer.policy_version)
            row = _step_row(step, trainer, attempts, report, samples, dropped, stats,
                            rollout_seconds, started)
            metrics.append(row)
            metrics.plot()
            if report.left_out:
                logger.warning("step %d left out rollouts: %s", step + 1, dict(report.left_out))
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", version=trainer.policy_version,
                            rps=f"{row['rollouts_per_s']:.1f}")
            reached = settings.stop_at_reward is not None and row["reward_mean"] >= settings.stop_at_reward
            good_steps = good_steps + 1 if reached else 0
            if good_steps >= 2:
                logger.info("reward_mean reached %.2f for 2 steps: stopping", settings.stop_at_reward)
                break
        final_checkpoint = trainer.save_checkpoint(
            os.path.join(checkpoints, f"step-{trainer.step:06d}"))
    rewards = [r["reward_mean"] for r in metrics.rows]
    return {
        "steps": len(metrics.rows),
        "first_reward": rewards[0] if rewards else None,
        "last_reward": rewards[-1] if rewards else None,
        "policy_version": trainer.policy_version,
        "metrics": metrics.path,
        "plot": metrics.plot_path,
        "checkpoint": str(final_checkpoint),
    }
