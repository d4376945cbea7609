"""Asynchronous vs synchronous training on the calculator demo with agents of uneven speed.

The demo's pieces (``spanrl.demo``): a tiny model warm-started once, then for each mode a
fresh receiver and runner (the calculator agent, one attempt in four slowed down by
``uneven_calc_agent``) and ``run_training`` with ``async_training`` off and on
(``max_staleness``, ``off_policy_rollouts: correct``). Reported per mode: rollouts/s over the
whole run, wall-clock seconds, reward per step with its wall-clock time, off-policy rollouts;
a PNG of reward vs wall-clock for both.

    python bench/bench_async.py --steps 3 --sft-steps 200            # brief
    python bench/bench_async.py --steps 12 --out bench-async         # the measured run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import replace

from spanrl.child_processes import LocalServices, free_port
from spanrl.demo import CALC_REWARD, DemoSettings, prepare_model
from spanrl.schema import metrics as keys

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


def write_tasks(path: str, seed: int) -> None:
    from spanrl.examples.calc_agent.tasks import make_tasks

    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(task) + "\n" for task in make_tasks(1000, seed=seed + 1))


def run_mode(mode: str, args: argparse.Namespace, model_dir: str, tasks: str) -> dict:
    """One training run (``sync`` or ``async``) with its own receiver, runner and store."""
    from spanrl.trainer_bridge.session import run_training
    from spanrl.trainer_bridge.train_settings import TrainSettings

    out = os.path.join(args.out, mode)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    policy_port, bridge_port = free_port(), free_port()
    env = {**os.environ, "UNEVEN_SLOW_S": str(args.slow_s), "UNEVEN_SLOW_EVERY": str(args.slow_every)}
    with LocalServices(out, stop_timeout_s=30) as services:
        receiver = services.start_receiver(os.path.join(out, "spanrl.db"))
        services.start_runner("uneven_calc_agent:solve", bridge_port, receiver, args.concurrency,
                              "--python-path", BENCH_DIR, env=env)
        settings = TrainSettings(
            tasks=tasks, model=model_dir, output_dir=os.path.join(out, "run"), store=os.path.join(out, "spanrl.db"),
            reward=CALC_REWARD, group_size=args.group_size, tasks_per_step=args.tasks_per_step, steps=args.steps,
            learning_rate=2e-4, rollout_timeout_s=120.0, checkpoint_every=0, policy_port=policy_port,
            bridge_port=bridge_port, device=args.device, seed=0,
            async_training=mode == "async", max_staleness=args.max_staleness)
        started = time.monotonic()
        summary = run_training(settings, show_progress=False)
        wall_s = time.monotonic() - started
    rows = keys.read_metrics(summary["metrics"])
    elapsed, curve = 0.0, []
    for row in rows:
        elapsed += row[keys.STEP_SECONDS]
        curve.append((round(elapsed, 1), round(row[keys.REWARD_MEAN], 3)))
    rollouts = sum(r[keys.ROLLOUTS] for r in rows)
    return {"mode": mode, "wall_s": round(wall_s, 1), "steps": len(rows), "rollouts": rollouts,
            "rollouts_per_s": round(rollouts / sum(r[keys.STEP_SECONDS] for r in rows), 3),
            "reward_vs_seconds": curve,
            "rollouts_off_policy": sum(r.get(keys.ROLLOUTS_OFF_POLICY, 0) for r in rows),
            "rollouts_left_out": [r[keys.ROLLOUTS_LEFT_OUT] for r in rows]}


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for result in results:
        seconds, rewards = zip(*result["reward_vs_seconds"], strict=True)
        ax.plot(seconds, rewards, marker="o", label=f"{result['mode']} ({result['rollouts_per_s']:.2f} rollouts/s)")
    ax.set_xlabel("wall-clock seconds")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-async")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--slow-s", type=float, default=4.0, help="delay of a slow agent, seconds")
    parser.add_argument("--slow-every", type=int, default=4, help="one attempt in this many is slow")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modes", default="sync,async")
    args = parser.parse_args()
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    model_dir = prepare_model(replace(DemoSettings(), sft_steps=args.sft_steps, device=args.device), args.out)
    tasks = os.path.join(args.out, "tasks.jsonl")
    write_tasks(tasks, seed=0)
    results = [run_mode(mode, args, model_dir, tasks) for mode in args.modes.split(",")]
    plot(results, os.path.join(args.out, "reward_vs_wall_clock.png"))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
