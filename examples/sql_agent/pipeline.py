"""The Text-to-SQL example end to end: a local model, its warm start, training, validation.

Each step is the component a user would run by hand (README, "A multi-agent Text-to-SQL agent"):
``prepare_model`` is ``spanrl model init`` + a warm start on ``demonstrations.py``; ``train`` starts
``spanrl receive`` (with ``air_rules.yaml`` or without AIR, credit ``discounted``) and ``spanrl run``
(the harness ``rollout:solve``) as child processes and runs ``spanrl train``'s loop in this process
with ``agents: [writer, rewriter]``; ``evaluate`` serves a checkpoint and runs the agents greedily on
the validation questions. Called by ``python -m spanrl.examples.sql_agent.pipeline``, by
``bench/bench_sql_air.py`` and by the example's training test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

EXAMPLE_DIR = Path(__file__).resolve().parent
TRAIN_TASKS = EXAMPLE_DIR / "train.jsonl"
VALIDATION_TASKS = EXAMPLE_DIR / "val.jsonl"
AIR_RULES = EXAMPLE_DIR / "air_rules.yaml"
HARNESS = "spanrl.examples.sql_agent.rollout:solve"
TRAINED_AGENTS = ("writer", "rewriter")  # the checker stays frozen


@dataclass(frozen=True)
class WarmStart:
    """The local model and its supervised warm start on the demonstrations."""

    preset: str = "tiny"
    vocab_size: int = 512
    steps: int = 600
    batch_size: int = 32
    learning_rate: float = 1e-3
    near_miss_share: float = 0.3
    seed: int = 0
    device: str = "cpu"


@dataclass(frozen=True)
class TrainingRun:
    """One GRPO run of the example; ``air`` turns the receiver's ``air_rules.yaml`` on."""

    output_dir: str
    model_dir: str
    air: bool = True
    steps: int = 10
    group_size: int = 8
    tasks_per_step: int = 8
    learning_rate: float = 2e-4
    concurrency: int = 16
    seed: int = 0
    device: str = "cpu"
    checkpoint_every: int = 1
    rollout_timeout_s: float = 300.0
    agents: tuple[str, ...] = field(default=TRAINED_AGENTS)


def prepare_model(out: str, warm: WarmStart, progress: bool = True) -> str:
    """Create the local model and warm-start it on fresh demonstrations; returns the warm model's folder."""
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer, TrainerConfig

    from .demonstrations import demonstration_batches, write_demonstrations, write_tokenizer_corpus

    os.makedirs(out, exist_ok=True)
    demonstrations = os.path.join(out, "demonstrations.jsonl")
    corpus = os.path.join(out, "tool_text.txt")
    write_demonstrations(demonstrations, count=2000, seed=warm.seed, near_miss_share=warm.near_miss_share)
    write_tokenizer_corpus(corpus, demonstrations)
    base_dir = os.path.join(out, "model-init")
    warm_dir = os.path.join(out, "model-warm")
    create_model_dir(base_dir, preset=warm.preset, corpus_files=[demonstrations, corpus],
                     vocab_size=warm.vocab_size, seed=warm.seed, overwrite=True)
    trainer = TorchTrainer(base_dir, TrainerConfig(sft_learning_rate=warm.learning_rate, device=warm.device,
                                                   seed=warm.seed))
    batches = demonstration_batches(warm.steps, warm.batch_size, seed=warm.seed,
                                    near_miss_share=warm.near_miss_share)
    trainer.sft_steps(batches, lr=warm.learning_rate, max_steps=warm.steps, progress=progress)
    trainer.save_checkpoint(warm_dir)
    return warm_dir


def train(run: TrainingRun, progress: bool = True) -> dict:
    """GRPO on the example with a receiver and a runner of its own; ``run_training``'s summary.

    Writes ``spanrl.db``, ``receiver.log``, ``runner.log`` and ``run/`` (metrics, checkpoints) into
    ``run.output_dir``, which starts afresh."""
    from spanrl.child_processes import LocalServices, free_port
    from spanrl.trainer_bridge.session import run_training
    from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
    from spanrl.trainer_bridge.train_settings import TrainSettings

    out = os.path.abspath(run.output_dir)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    db = os.path.join(out, "spanrl.db")
    policy_port, bridge_port = free_port(), free_port()
    with LocalServices(out, stop_timeout_s=15) as services:
        receiver = services.start_receiver(db, "--credit", "discounted",
                                           "--air-rules", str(AIR_RULES) if run.air else "off")
        services.start_runner(HARNESS, bridge_port, receiver, run.concurrency, "--bridge-wait-s", "300")
        settings = TrainSettings(
            tasks=str(TRAIN_TASKS), model=run.model_dir, output_dir=os.path.join(out, "run"), store=db,
            reward="events", advantage_level="transition", agents=list(run.agents),
            group_size=run.group_size, tasks_per_step=run.tasks_per_step, steps=run.steps,
            learning_rate=run.learning_rate, rollout_timeout_s=run.rollout_timeout_s,
            checkpoint_every=run.checkpoint_every, policy_port=policy_port, bridge_port=bridge_port,
            device=run.device, seed=run.seed, receiver_wait_s=60.0,
            # every checkpoint of the run is kept: bench_sql_air.py scores each step's
            trainer=TrainerConfig(keep_checkpoints=max(2, run.steps // max(1, run.checkpoint_every) + 1)))
        return run_training(settings, show_progress=progress)


def load_tasks(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def evaluate(model_dir: str, tasks: list[dict], concurrency: int = 16, device: str = "cpu") -> float:
    """Execution accuracy of the agents (greedy: temperature 0) served by ``model_dir`` on ``tasks``."""
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process

    from . import agent
    from .reward import execution_match

    engine = PolicyEngine.from_pretrained(model_dir, device=device, model_name="policy").start()
    handle = serve_in_process(engine, "127.0.0.1", 0, None)
    try:
        config = agent.ModelConfig(base_url=handle.base_url, model="policy", temperature=0.0)

        def score(task: dict) -> float:
            return execution_match(agent.answer(task["question"], config), task["answer"])

        with ThreadPoolExecutor(concurrency) as pool:
            scores = list(pool.map(score, tasks))
    finally:
        handle.stop()
        engine.stop()
    return sum(scores) / len(scores) if scores else 0.0


def checkpoints_by_step(run_dir: str) -> list[tuple[int, str]]:
    """``(step, folder)`` of every ``step-NNNNNN`` checkpoint of a run, in step order."""
    root = Path(run_dir) / "checkpoints"
    found = []
    for path in sorted(root.glob("step-*")):
        if (path / "trainer_state.json").exists():
            found.append((int(path.name.split("-")[1]), str(path)))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="train the Text-to-SQL example (writer and rewriter) on CPU")
    parser.add_argument("--output-dir", default="runs/sql_agent")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sft-steps", type=int, default=WarmStart.steps)
    parser.add_argument("--no-air", action="store_true", help="train without the AIR rules")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    started = time.monotonic()
    warm_dir = prepare_model(os.path.join(args.output_dir, "model"),
                             WarmStart(steps=args.sft_steps, seed=args.seed, device=args.device))
    validation = load_tasks(VALIDATION_TASKS)
    print(f"warm start done: validation accuracy {evaluate(warm_dir, validation, device=args.device):.2f}")
    summary = train(TrainingRun(output_dir=os.path.join(args.output_dir, "train"), model_dir=warm_dir,
                                air=not args.no_air, steps=args.steps, seed=args.seed, device=args.device))
    accuracy = evaluate(summary["checkpoint"], validation, device=args.device)
    print(f"after {summary['steps']} steps: validation accuracy {accuracy:.2f}; {time.monotonic() - started:.0f} s; "
          f"metrics {summary['metrics']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
