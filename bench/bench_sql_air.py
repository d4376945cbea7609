"""AIR or not: the Text-to-SQL example trained with the receiver's AIR rules and without, same seeds.

Both arms start from one warm-started model (``examples/sql_agent``: ``spanrl model init`` + SFT on
the example's demonstrations) and run the same GRPO settings and seed; they differ in one thing:
``spanrl receive --air-rules examples/sql_agent/air_rules.yaml`` (a failing ``run_sql`` is a -0.3
reward on the call that wrote the query) or ``--air-rules off``. Both train ``writer`` and
``rewriter`` only (the checker stays frozen), credit ``discounted``, transition-level advantages.
After every step the arm's checkpoint is served and the agents answer the validation questions
greedily (temperature 0); the score is the execution match with the gold answer.

    python bench/bench_sql_air.py [--steps 20 --sft-steps 600 --seeds 0 1 --device cpu]

Prints validation accuracy per step for both arms (step 0 = the warm start) and writes
``results.json`` into ``--output-dir``. It runs the whole loop (receiver, runner, trainer) twice per
seed; on a busy 2-core machine plan on minutes per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def run_arm(out: Path, warm_dir: str, air: bool, args: argparse.Namespace, seed: int,
            validation: list[dict]) -> dict:
    from spanrl.examples.sql_agent.pipeline import TrainingRun, checkpoints_by_step, evaluate, train

    started = time.monotonic()
    summary = train(TrainingRun(
        output_dir=str(out), model_dir=warm_dir, air=air, steps=args.steps, group_size=args.group_size,
        tasks_per_step=args.tasks_per_step, learning_rate=args.learning_rate, concurrency=args.concurrency,
        seed=seed, device=args.device, checkpoint_every=1), progress=False)
    train_seconds = time.monotonic() - started
    accuracy = {}
    for step, checkpoint in checkpoints_by_step(os.path.join(out, "run")):
        accuracy[step] = evaluate(checkpoint, validation, concurrency=args.concurrency, device=args.device)
        print(f"  {'AIR' if air else 'no AIR'} seed {seed} step {step}: validation accuracy {accuracy[step]:.3f}",
              flush=True)
    from spanrl.schema.metrics import REWARD_MEAN, read_metrics

    rewards = [row[REWARD_MEAN] for row in read_metrics(summary["metrics"])]
    return {"accuracy": accuracy, "train_reward": rewards, "train_seconds": train_seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--output-dir", default="runs/bench_sql_air")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from spanrl.examples.sql_agent.pipeline import VALIDATION_TASKS, WarmStart, evaluate, load_tasks, prepare_model

    out = Path(args.output_dir).resolve()
    validation = load_tasks(VALIDATION_TASKS)
    results: dict = {"settings": vars(args), "validation_questions": len(validation), "seeds": {}}
    for seed in args.seeds:
        started = time.monotonic()
        warm_dir = prepare_model(str(out / f"seed-{seed}" / "model"),
                                 WarmStart(steps=args.sft_steps, seed=seed, device=args.device), progress=False)
        warm_accuracy = evaluate(warm_dir, validation, concurrency=args.concurrency, device=args.device)
        print(f"seed {seed}: warm start in {time.monotonic() - started:.0f} s, validation accuracy "
              f"{warm_accuracy:.3f}", flush=True)
        arms = {}
        for air in (True, False):
            arm = run_arm(out / f"seed-{seed}" / ("air" if air else "no-air"), warm_dir, air, args, seed, validation)
            arm["accuracy"] = {0: warm_accuracy, **arm["accuracy"]}
            arms["air" if air else "no_air"] = arm
        results["seeds"][seed] = arms
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")

    print("\nvalidation accuracy per step (step 0 = warm start)")
    for seed, arms in results["seeds"].items():
        steps = sorted(arms["air"]["accuracy"])
        print(f"seed {seed}  step:   " + " ".join(f"{s:>5d}" for s in steps))
        for name in ("air", "no_air"):
            accuracy = arms[name]["accuracy"]
            print(f"seed {seed}  {name:<7s} " + " ".join(f"{accuracy.get(s, float('nan')):5.2f}" for s in steps)
                  + f"   ({arms[name]['train_seconds']:.0f} s of training)")
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
