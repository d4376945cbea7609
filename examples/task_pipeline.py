"""What every example task's pipeline does: a local model, its warm start, a training run with
held-out validation, and the held-out accuracy of a model, each through the real components.

Each task (``sql_agent``, ``retrieval_qa``, ``calc_autogen``) describes itself in a ``Task``: its
task files, its reward, how ``spanrl run`` runs its agent (with which Python: AutoGen runs in its
own venv), the receiver's AIR rules and credit, and its warm-start demonstrations. Then:

- ``prepare_model``: ``spanrl model init`` (a tokenizer shaped by the demonstrations) and a
  supervised warm start on the task's demonstrations;
- ``train``: ``spanrl receive`` and ``spanrl run`` as child processes, ``spanrl train``'s loop in this
  process with ``val_tasks`` scored greedily (``val_temperature: 0``) every ``val_every`` steps;
- ``held_out_accuracy``: the same with ``--val-only`` on one model (the warm start's score).

Accuracy counts every held-out rollout: one that failed or could not be scored counts as wrong.
Called by each task's ``pipeline.py``, by ``bench/learning.py`` and by the examples' tests.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class WarmStart:
    """The local model and its supervised warm start on the task's demonstrations."""

    preset: str = "tiny"
    vocab_size: int = 512
    steps: int = 400
    batch_size: int = 32
    learning_rate: float = 1e-3
    share: float | None = None  # the demonstrations' share of the weaker behaviour (None: the task's)
    seed: int = 0
    device: str = "cpu"


@dataclass(frozen=True)
class Task:
    """One example task, as the pipeline runs it."""

    name: str
    train_tasks: Path
    val_tasks: Path
    reward: str  # 'events' or module:function (train.yaml's reward)
    agent: str  # spanrl run's --agent
    write_demonstrations: Callable[..., None]  # (path, count, seed, share)
    write_tokenizer_corpus: Callable[[str, str], None]  # (path, demonstrations file)
    demonstration_batches: Callable[..., Iterator[list[dict]]]  # (steps, batch_size, seed, share)
    demonstration_share: float  # the share of the demonstrator's weaker behaviour
    runner_python: str = sys.executable  # the Python whose spanrl runs the agent
    air_rules: str = "off"
    credit: str = "identical"
    advantage_level: str = "rollout"
    agents: tuple[str, ...] = ()  # selective optimisation: train only these agents' calls
    accuracy_event: str | None = None  # score validation by this reward event alone (else by the reward)
    graded_reward: str | None = None  # a graded reward to train on (bench/learning.py's arm grpo_graded)
    graded_call_reward: str | None = None  # a reward with per-call rewards (the arm grpo_graded_calls)
    warm_start: WarmStart = WarmStart()  # the warm start's defaults for this task (steps, batch size)


@dataclass(frozen=True)
class TrainingRun:
    """One training run of a task; ``settings`` are more ``TrainSettings`` fields (e.g. kl_coef, or
    ``adapters``: one LoRA adapter per agent); ``runner_env`` is added to ``spanrl run``'s environment
    (e.g. ``SQL_AGENT_MODEL_PER_NODE=1``)."""

    output_dir: str
    model_dir: str
    algorithm: str = "grpo"
    steps: int = 10
    group_size: int = 8
    tasks_per_step: int = 8
    learning_rate: float = 2e-4
    val_every: int = 2
    concurrency: int = 16
    seed: int = 0
    device: str = "cpu"
    rollout_timeout_s: float = 300.0
    air: bool = True  # the task's AIR rules (when it has any)
    credit: str | None = None  # None: the task's
    agents: tuple[str, ...] | None = None  # None: the task's
    val_tasks: str | None = None  # None: the task's validation file
    settings: dict[str, Any] = field(default_factory=dict)
    runner_env: dict[str, str] = field(default_factory=dict)  # more environment of the agent's processes
    endpoint_spans: bool = False  # the policy endpoint's own span of each call -> the run's receiver


def prepare_model(task: Task, out: str, warm: WarmStart, progress: bool = True) -> str:
    """Create the local model and warm-start it on fresh demonstrations; returns the warm model's folder."""
    from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

    share = task.demonstration_share if warm.share is None else warm.share
    os.makedirs(out, exist_ok=True)
    demonstrations = os.path.join(out, "demonstrations.jsonl")
    corpus = os.path.join(out, "tool_text.txt")
    task.write_demonstrations(demonstrations, 2000, warm.seed, share)
    task.write_tokenizer_corpus(corpus, demonstrations)
    base_dir, warm_dir = os.path.join(out, "model-init"), os.path.join(out, "model-warm")
    create_model_dir(base_dir, preset=warm.preset, corpus_files=[demonstrations, corpus],
                     vocab_size=warm.vocab_size, seed=warm.seed, overwrite=True)
    trainer = TorchTrainer(base_dir, TrainerConfig(sft_learning_rate=warm.learning_rate, device=warm.device,
                                                   seed=warm.seed))
    batches = task.demonstration_batches(warm.steps, warm.batch_size, warm.seed, share)
    trainer.sft_steps(batches, lr=warm.learning_rate, max_steps=warm.steps, progress=progress)
    trainer.save_checkpoint(warm_dir)
    return warm_dir


def train(task: Task, run: TrainingRun, progress: bool = True) -> dict:
    """A training run with a receiver and a runner of its own: ``run_training``'s summary plus
    ``accuracy`` (held-out accuracy after each validated step) and ``output_dir``. Writes
    ``spanrl.db``, ``receiver.log``, ``runner.log`` and ``run/`` into ``run.output_dir`` (afresh)."""
    from spanrl.trainer_bridge.session import run_training

    with _services(task, run) as (settings, db):
        summary = run_training(settings, show_progress=progress)
    from spanrl.schema.metrics import read_metrics

    rows = read_metrics(summary["metrics"])
    return {**summary, "rows": rows, "accuracy": validation_accuracy(task, db, rows),
            "output_dir": os.path.abspath(run.output_dir)}


def held_out_accuracy(task: Task, model_dir: str, out: str, seed: int = 0, device: str = "cpu",
                      concurrency: int = 16, val_tasks: str | None = None) -> float:
    """Greedy held-out accuracy of ``model_dir`` (``spanrl train --val-only`` through a runner)."""
    from spanrl.trainer_bridge.session import run_training

    run = TrainingRun(output_dir=out, model_dir=model_dir, seed=seed, device=device, concurrency=concurrency,
                      val_tasks=val_tasks, settings={"val_only": True})
    with _services(task, run) as (settings, db):
        result = run_training(settings, show_progress=False)["validation"]
    if task.accuracy_event:
        return _event_accuracy(db, task.accuracy_event, result.rollouts).get(result.step, 0.0)
    return _accuracy(result.val_reward, result.rollouts_scored, result.rollouts)


class _services:
    """``spanrl receive`` and ``spanrl run`` for one run (context manager: stopped on exit), and
    the ``TrainSettings`` that point at them."""

    def __init__(self, task: Task, run: TrainingRun) -> None:
        self.task, self.run = task, run
        self.spans_env: str | None = None  # the environment's spans endpoint before (endpoint_spans)

    def __enter__(self) -> tuple[Any, str]:
        from spanrl.child_processes import LocalServices, free_port

        task, run = self.task, self.run
        out = os.path.abspath(run.output_dir)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        db = os.path.join(out, "spanrl.db")
        policy_port, bridge_port = free_port(), free_port()
        self.services = LocalServices(out, stop_timeout_s=15)
        try:
            receiver = self.services.start_receiver(db, "--credit", run.credit or task.credit,
                                                    "--air-rules", task.air_rules if run.air else "off")
            self.services.start_runner(task.agent, bridge_port, receiver, run.concurrency, "--bridge-wait-s", "600",
                                       python=task.runner_python,
                                       env={**os.environ, **run.runner_env} if run.runner_env else None)
            if run.endpoint_spans:  # read when the policy server starts (trainer_bridge/endpoint_spans.py)
                from spanrl.trainer_bridge.endpoint_spans import SPANS_ENDPOINT_ENV

                self.spans_env = os.environ.get(SPANS_ENDPOINT_ENV)
                os.environ[SPANS_ENDPOINT_ENV] = receiver.otlp_endpoint
            return self._settings(out, db, policy_port, bridge_port), db
        except BaseException:
            self.services.stop()
            raise

    def _settings(self, out: str, db: str, policy_port: int, bridge_port: int) -> Any:
        from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
        from spanrl.trainer_bridge.train_settings import TrainSettings

        task, run = self.task, self.run
        agents = task.agents if run.agents is None else run.agents
        extra = dict(run.settings)
        trainer = extra.pop("trainer", {})  # a TrainerConfig, or its keys as a dict: {"ppo_epochs": 4}
        if not isinstance(trainer, TrainerConfig):
            trainer = TrainerConfig(**{"keep_checkpoints": 1, **trainer})
        return TrainSettings(**{
            "tasks": str(task.train_tasks), "val_tasks": run.val_tasks or str(task.val_tasks), "model": run.model_dir,
            "output_dir": os.path.join(out, "run"), "store": db, "reward": task.reward,
            "advantage_level": task.advantage_level, "agents": list(agents), "algorithm": run.algorithm,
            "group_size": run.group_size, "tasks_per_step": run.tasks_per_step, "steps": run.steps,
            "learning_rate": run.learning_rate, "val_every": run.val_every, "val_temperature": 0.0,
            "rollout_timeout_s": run.rollout_timeout_s, "checkpoint_every": 0, "policy_port": policy_port,
            "bridge_port": bridge_port, "device": run.device, "seed": run.seed, "receiver_wait_s": 60.0,
            "runner_wait_warn_s": 120.0, "trainer": trainer, **extra})

    def __exit__(self, *exc: object) -> None:
        self.services.stop()
        if self.run.endpoint_spans:
            from spanrl.trainer_bridge.endpoint_spans import SPANS_ENDPOINT_ENV

            if self.spans_env is None:
                os.environ.pop(SPANS_ENDPOINT_ENV, None)
            else:
                os.environ[SPANS_ENDPOINT_ENV] = self.spans_env


def held_out_by_kind(task: Task, out: str, val_tasks: str | None = None) -> dict[str, float]:
    """Held-out accuracy of the last validation round under ``out`` (a ``train`` or
    ``held_out_accuracy`` output folder), by the validation tasks' ``kind`` field: each task's
    score (``validation.jsonl``'s last line, or ``--val-only``'s ``validation.json``), a task with
    no scored rollout counting 0. Empty when the tasks have no kind, or when the task's accuracy is a
    reward event (its round scores then carry other rewards too)."""
    from spanrl.trainer_bridge.validation import RESULT_FILE, VALIDATION_LOG

    tasks = [json.loads(line) for line in open(val_tasks or task.val_tasks, encoding="utf-8") if line.strip()]
    if task.accuracy_event or not all("kind" in t for t in tasks):
        return {}
    run_dir = os.path.join(out, "run")
    log, single = os.path.join(run_dir, VALIDATION_LOG), os.path.join(run_dir, RESULT_FILE)
    if os.path.exists(log):
        with open(log, encoding="utf-8") as f:
            record = json.loads(f.read().splitlines()[-1])
    else:
        with open(single, encoding="utf-8") as f:
            record = json.load(f)
    scores: dict[str, list[float]] = {}
    for t in tasks:
        scores.setdefault(t["kind"], []).append(float(record["task_scores"].get(str(t["id"]), 0.0)))
    return {kind: sum(values) / len(values) for kind, values in sorted(scores.items())}


def _accuracy(val_reward: float | None, scored: int, rollouts: int) -> float:
    """Mean score over every rollout (unscored ones count 0)."""
    return 0.0 if not rollouts or val_reward is None else val_reward * scored / rollouts


def validation_accuracy(task: Task, db: str, rows: list[dict]) -> dict[int, float]:
    """``{step: accuracy}`` of every validated step of a run (``rows``: ``read_metrics``'s)."""
    from spanrl.schema import metrics as keys

    if task.accuracy_event:
        totals = {row[keys.STEP]: row[keys.VAL_ROLLOUTS] for row in rows if keys.VAL_ROLLOUTS in row}
        found = _event_accuracy(db, task.accuracy_event, max(totals.values(), default=0))
        return {step: found.get(step, 0.0) for step in totals}
    return {row[keys.STEP]: _accuracy(row.get(keys.VAL_REWARD), row[keys.VAL_ROLLOUTS_SCORED], row[keys.VAL_ROLLOUTS])
            for row in rows if keys.VAL_ROLLOUTS in row}


def _event_accuracy(db: str, reward_name: str, rollouts_per_round: int) -> dict[int, float]:
    """``{step: the reward event reward_name summed over a validation round's ok rollouts, divided
    by rollouts_per_round}`` (for a task whose training reward adds other rewards, e.g. the SQL
    example's AIR penalties; a rollout missing from the store counts 0)."""
    from spanrl.bridge_protocol import VALIDATION_ROLLOUT_PREFIX
    from spanrl.otlp_receiver.store import SpanStore

    rollouts, _ = SpanStore(db).completed_rollouts(since=0)
    values: dict[int, list[float]] = {}
    for rollout in rollouts:
        if not rollout.rollout_id.startswith(VALIDATION_ROLLOUT_PREFIX):
            continue
        step = int(rollout.rollout_id[len(VALIDATION_ROLLOUT_PREFIX):].split("-", 1)[0])
        value = sum(r.value for r in rollout.rewards if r.name == reward_name and rollout.status == "ok")
        values.setdefault(step, []).append(value)
    return {step: sum(v) / max(rollouts_per_round, len(v)) for step, v in sorted(values.items())}


def example_main(task: Task, description: str, argv: list[str] | None = None,
                 check: Callable[[], None] | None = None) -> int:
    """A task's ``pipeline.py`` command line: warm start, its held-out accuracy, then training with
    held-out accuracy every ``--val-every`` steps, printed as one curve. ``check`` runs once the
    arguments are read (e.g. that the agent's own venv exists)."""
    import argparse
    import time

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output-dir", default=f"runs/{task.name}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--val-every", type=int, default=2)
    parser.add_argument("--sft-steps", type=int, default=task.warm_start.steps)
    parser.add_argument("--algorithm", default="grpo", choices=("grpo", "sft"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if check is not None:
        check()
    started = time.monotonic()
    warm_dir = prepare_model(task, os.path.join(args.output_dir, "model"),
                             replace(task.warm_start, steps=args.sft_steps, seed=args.seed, device=args.device))
    warm = held_out_accuracy(task, warm_dir, os.path.join(args.output_dir, "warm-validation"), seed=args.seed,
                             device=args.device)
    print(f"warm start done: held-out accuracy {warm:.2f}")
    summary = train(task, TrainingRun(output_dir=os.path.join(args.output_dir, "train"), model_dir=warm_dir,
                                      algorithm=args.algorithm, steps=args.steps, val_every=args.val_every,
                                      seed=args.seed, device=args.device))
    curve = " ".join(f"{step}:{value:.2f}" for step, value in summary["accuracy"].items())
    print(f"held-out accuracy by step: 0:{warm:.2f} {curve}; {time.monotonic() - started:.0f} s; "
          f"metrics {summary['metrics']}")
    return 0
