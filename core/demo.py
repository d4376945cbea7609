"""``spanrl demo``: the whole loop on the bundled calculator agent, on CPU, in minutes.

What it does, in order (every step is a real component a user would run themselves):
1. ``spanrl model init --preset tiny``: a small model and a tokenizer built here;
2. a warm start (SFT on calculator demonstrations) so RL has signal;
3. ``spanrl receive`` in a child process (OTLP/gRPC + the SQLite store);
4. the trainer bridge in this process, with the embedded policy server;
5. ``spanrl run`` in a child process: the unmodified OpenAI-SDK calculator agent, traced
   by OpenTelemetry and exported over OTLP/gRPC to the receiver;
then GRPO steps until the reward reaches the target. Agents call the same URL throughout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from dataclasses import dataclass

from spanrl.child_processes import LocalServices, free_port
from spanrl.errors import SettingError
from spanrl.settings_loader import CommandSettings, setting

CALC_AGENT = "spanrl.examples.calc_agent.agent:solve"
CALC_REWARD = "spanrl.examples.calc_agent.reward:reward"




@dataclass(frozen=True)
class DemoSettings:
    output_dir: str = setting("spanrl-demo", "where everything is written")
    steps: int = setting(30, "at most this many GRPO steps")
    stop_at_reward: float = setting(0.95, "stop once the mean reward reaches this for 2 steps")
    sft_steps: int = setting(400, "warm-start SFT steps")
    sft_batch_size: int = setting(64, "warm-start SFT batch size")
    # 1e-3: at 3e-3 the tiny model stays on the plateau where it has not learned to copy.
    sft_learning_rate: float = setting(1e-3, "warm-start SFT learning rate")
    group_size: int = setting(8, "rollouts per task (G)")
    tasks_per_step: int = setting(16, "tasks per GRPO update")
    learning_rate: float = setting(2e-4, "GRPO learning rate")
    concurrency: int = setting(32, "agents running at once")
    seed: int = setting(0, "random seed")
    threads: int = setting(0, "torch threads for the trainer (0 = torch's default)")
    device: str = setting("cpu", "where the model trains and serves: cpu, cuda, cuda:N or auto (docs/gpu.md)")
    backend: str = setting("torch", "torch (embedded) or verl (verl's workers train, vLLM serves; docs/verl.md)")
    merge_trajectories: bool = setting(False, "train each rollout's calls as one masked row (docs/algorithms.md)")
    async_training: bool = setting(False, "update on finished groups while others run (docs/algorithms.md)")
    max_staleness: int = setting(1, "async_training: policy versions a rollout may lag behind")
    model: str = setting("", "a warm-started model folder to train (a former demo's <output-dir>/model-warm): "
                             "no new model, no warm start")


SETTINGS = CommandSettings("demo", DemoSettings, "DEMO")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train the bundled calculator agent end to end on CPU",
        description=(__doc__ or "").splitlines()[0],
    )
    SETTINGS.add_to(parser)
    parser.set_defaults(func=demo_command)


def prepare_model(settings: DemoSettings, out: str) -> str:
    """Create the tiny model and warm-start it; returns the warm model's directory."""
    from spanrl.examples.calc_agent.demonstrations import curriculum_batches, write_demonstrations
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer, TrainerConfig

    base_dir = os.path.join(out, "model-init")
    warm_dir = os.path.join(out, "model-warm")
    corpus = os.path.join(out, "demonstrations.jsonl")
    write_demonstrations(corpus, count=2000, seed=settings.seed)
    create_model_dir(base_dir, preset="tiny", corpus_files=[corpus], seed=settings.seed,
                     overwrite=True)
    print(f"[1/3] created a tiny model in {base_dir}")
    started = time.monotonic()
    trainer = TorchTrainer(base_dir, TrainerConfig(sft_learning_rate=settings.sft_learning_rate, device=settings.device,
                                                   seed=settings.seed))
    batches = curriculum_batches(settings.sft_steps, settings.sft_batch_size, seed=settings.seed)
    trainer.sft_steps(batches, lr=settings.sft_learning_rate, max_steps=settings.sft_steps)
    trainer.save_checkpoint(warm_dir)
    print(f"[2/3] warm start: {settings.sft_steps} SFT steps in {time.monotonic() - started:.0f} s "
          f"-> {warm_dir}")
    return warm_dir


def reuse_model(model_dir: str) -> str:
    """The warm model of an earlier demo, checked before anything starts."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise SettingError(f"--model {model_dir!r}: not a model folder (no config.json there); give a former "
                           "demo's <output-dir>/model-warm, or leave --model out to create one")
    print(f"[1-2/3] the warm model of an earlier run, no warm start: {model_dir}")
    return os.path.abspath(model_dir)


def demo_command(settings: DemoSettings) -> int:
    from spanrl.trainer_bridge.session import run_training
    from spanrl.trainer_bridge.train_settings import TrainSettings

    if settings.threads:
        import torch

        torch.set_num_threads(settings.threads)
    out = os.path.abspath(settings.output_dir)
    os.makedirs(out, exist_ok=True)
    started = time.monotonic()
    model_dir = reuse_model(settings.model) if settings.model else prepare_model(settings, out)

    tasks_file = os.path.join(out, "tasks.jsonl")
    from spanrl.examples.calc_agent.tasks import make_tasks

    with open(tasks_file, "w", encoding="utf-8") as f:
        import json

        for task in make_tasks(1000, seed=settings.seed + 1):
            f.write(json.dumps(task) + "\n")

    shutil.rmtree(os.path.join(out, "run"), ignore_errors=True)  # the demo starts afresh
    db = os.path.join(out, "spanrl.db")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.remove(db + suffix)
    policy_port, bridge_port = free_port(), free_port()
    try:
        with LocalServices(out) as services:
            receiver = services.start_receiver(db)
            # verl's workers and vLLM take minutes to start before the bridge is up
            services.start_runner(CALC_AGENT, bridge_port, receiver, settings.concurrency,
                                  "--bridge-wait-s", "1800" if settings.backend == "verl" else "120")
            print(f"[3/3] receiver on 127.0.0.1:{receiver.grpc} (OTLP/gRPC), policy on "
                  f"127.0.0.1:{policy_port}, runner with {settings.concurrency} agents; training:")
            train_settings = TrainSettings(
                tasks=tasks_file, model=model_dir, output_dir=os.path.join(out, "run"), store=db,
                reward=CALC_REWARD, group_size=settings.group_size, tasks_per_step=settings.tasks_per_step,
                steps=settings.steps, stop_at_reward=settings.stop_at_reward,
                learning_rate=settings.learning_rate, rollout_timeout_s=60.0, checkpoint_every=5,
                policy_port=policy_port, bridge_port=bridge_port, device=settings.device, seed=settings.seed,
                backend=settings.backend, merge_trajectories=settings.merge_trajectories,
                async_training=settings.async_training, max_staleness=settings.max_staleness,
            )
            summary = run_training(train_settings)
    except RuntimeError as exc:  # a component did not start: say where its log is
        print(f"spanrl demo: {exc}; see the logs in {out}")
        return 1
    print(_curve_text(summary["metrics"]))
    print(f"mean reward {summary['first_reward']:.2f} -> {summary['last_reward']:.2f} in "
          f"{summary['steps']} GRPO steps; {time.monotonic() - started:.0f} s in total")
    print(f"reward curve: {summary['plot']}\nmetrics: {summary['metrics']}\n"
          f"checkpoint (Hugging Face format): {summary['checkpoint']}\nlogs: {out}/*.log")
    return 0


def _curve_text(metrics_path: str) -> str:
    from spanrl.schema.metrics import REWARD_MEAN, read_metrics

    return "reward per step: " + " ".join(f"{r[REWARD_MEAN]:.2f}" for r in read_metrics(metrics_path))
