"""The Text-to-SQL example end to end: a local model, its warm start, training, held-out accuracy.

Each step is the component a user would run by hand (README, "A multi-agent Text-to-SQL agent"):
``prepare_model`` is ``spanrl model init`` + a warm start on ``demonstrations.py``; ``train`` starts
``spanrl receive`` (with ``air_rules.yaml``, or ``--air-rules off``; credit ``discounted``) and
``spanrl run`` (the harness ``rollout:solve``) as child processes and runs ``spanrl train``'s loop in
this process with ``agents: [writer, rewriter]``, scoring ``val.jsonl`` greedily every
``val_every`` steps (``examples/task_pipeline.py`` does the running). Held-out accuracy is the
``execution_match`` reward event alone (training's reward adds AIR's penalties). Called by
``python -m spanrl.examples.sql_agent.pipeline``, by ``bench/learning.py`` and by the example's tests.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from spanrl.examples import task_pipeline
from spanrl.examples.task_pipeline import Task, TrainingRun, WarmStart, held_out_accuracy

from . import demonstrations

EXAMPLE_DIR = Path(__file__).resolve().parent
TRAIN_TASKS = EXAMPLE_DIR / "train.jsonl"
VALIDATION_TASKS = EXAMPLE_DIR / "val.jsonl"
AIR_RULES = EXAMPLE_DIR / "air_rules.yaml"
TRAINED_AGENTS = ("writer", "rewriter")  # the checker stays frozen
TASK = Task(
    name="sql_agent",
    train_tasks=TRAIN_TASKS,
    val_tasks=VALIDATION_TASKS,
    reward="events",  # the harness's execution_match event + the receiver's AIR rewards
    agent="spanrl.examples.sql_agent.rollout:solve",
    write_demonstrations=demonstrations.write_demonstrations,
    write_tokenizer_corpus=demonstrations.write_tokenizer_corpus,
    demonstration_batches=demonstrations.demonstration_batches,
    demonstration_share=demonstrations.HASTY_SHARE,
    air_rules=str(AIR_RULES),
    credit="discounted",
    advantage_level="transition",
    agents=TRAINED_AGENTS,
    accuracy_event="execution_match",
    # with the hasty writer, 800 steps of 64 leave the warm start at 0.54-0.64 held-out, room to learn
    # (docs/results.md, 2026-11-29)
    warm_start=WarmStart(steps=800, batch_size=64),
)


def prepare_model(out: str, warm: WarmStart, progress: bool = True) -> str:
    """``task_pipeline.prepare_model`` for this example: the warm model's folder."""
    return task_pipeline.prepare_model(TASK, out, warm, progress)


def train(run: TrainingRun, progress: bool = True) -> dict:
    """``task_pipeline.train`` for this example (``run.air``: the AIR rules on or off)."""
    return task_pipeline.train(TASK, run, progress)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="train the Text-to-SQL example (writer and rewriter) on CPU")
    parser.add_argument("--output-dir", default="runs/sql_agent")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--val-every", type=int, default=2)
    parser.add_argument("--sft-steps", type=int, default=TASK.warm_start.steps)
    parser.add_argument("--no-air", action="store_true", help="train without the AIR rules")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    started = time.monotonic()
    warm_dir = prepare_model(os.path.join(args.output_dir, "model"),
                             replace(TASK.warm_start, steps=args.sft_steps, seed=args.seed, device=args.device))
    warm = held_out_accuracy(TASK, warm_dir, os.path.join(args.output_dir, "warm-validation"), seed=args.seed,
                             device=args.device)
    print(f"warm start done: held-out accuracy {warm:.2f}")
    summary = train(TrainingRun(output_dir=os.path.join(args.output_dir, "train"), model_dir=warm_dir,
                                air=not args.no_air, steps=args.steps, val_every=args.val_every, seed=args.seed,
                                device=args.device))
    curve = " ".join(f"{step}:{value:.2f}" for step, value in summary["accuracy"].items())
    print(f"held-out accuracy by step: 0:{warm:.2f} {curve}; {time.monotonic() - started:.0f} s; "
          f"metrics {summary['metrics']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
