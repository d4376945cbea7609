"""Automatic prompt optimization (``algorithm: apo``) on a task where the instructions decide the reward.

The reply-format agent (``examples/reply_format``) asks its model to reply with a word; the reward
wants the word in square brackets, which the agent's own prompt does not ask for. Its model is a
tiny one created here and warm-started on demonstrations where the system prompt decides the
format (under the agent's own prompt it mostly replies plainly). For each seed (a fresh model,
store, receiver and runner each time), two searches from the agent's own prompt, weights frozen:

- ``optimizer``: the starting prompt alone, edited by an optimizer model, here the same local
  model behind ``spanrl serve`` (the only model this machine has: it writes no usable prompt,
  so this mode shows the machinery and that a useless optimizer costs nothing but time);
- ``pool``: a user-given pool of candidates (the agent's prompt and three others), no optimizer.

Reported per seed and mode: the held-out reward (``val_tasks``: words never in a training batch,
``val_attempts`` sampled rollouts each) of the starting prompt and of the prompt APO chose, the
candidates proposed and dropped, and seconds. What a strong optimizer model would add (edits that
find the bracket format from the critique of plain replies) cannot be measured here: no such model
runs on this machine, and the tiny policy understands only the instructions it was taught.

    python bench/bench_apo.py --out bench-apo              # 2 seeds, both modes (about 10 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import yaml

from spanrl.child_processes import LocalServices, free_port, wait_for_port
from spanrl.examples.reply_format.agent import SYSTEM_PROMPT
from spanrl.examples.reply_format.demonstrations import STYLES, write_demonstrations, write_tasks

AGENT = "spanrl.examples.reply_format.agent:reply"
REWARD = "spanrl.examples.reply_format.reward:reward"
POOL_NAMES = dict(zip(STYLES, ("brackets", "quotes", "plain"), strict=True))  # instructions -> candidate name


def warm_model(root: str, seed: int, steps: int) -> str:
    """A tiny model warm-started on the format demonstrations (one torch thread: a shared machine)."""
    import torch

    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
    from spanrl.trainer_bridge.warm_start import WarmStartConfig, warm_start_model

    torch.set_num_threads(1)
    demonstrations = write_demonstrations(os.path.join(root, "demonstrations.jsonl"), 2000, seed=seed)
    base = create_model_dir(os.path.join(root, "model-init"), preset="tiny", corpus_files=[demonstrations], seed=seed)
    out = os.path.join(root, "model")
    warm_start_model(WarmStartConfig(demonstrations=demonstrations, steps=steps, batch_size=32, learning_rate=2e-3,
                                     seed=seed, device="cpu"), str(base), out, progress=False)
    return out


def search(mode: str, root: str, model: str, seed: int, args: argparse.Namespace) -> dict:
    """One APO run (``optimizer`` or ``pool``) with its own receiver, runner and store."""
    from spanrl.trainer_bridge.apo.config import ApoConfig
    from spanrl.trainer_bridge.session import run_training
    from spanrl.trainer_bridge.train_settings import TrainSettings

    work = os.path.join(root, mode)
    os.makedirs(work, exist_ok=True)
    tasks, val_tasks = write_tasks(os.path.join(work, "tasks.jsonl"), os.path.join(work, "val.jsonl"))
    candidates = {"original": SYSTEM_PROMPT}
    if mode == "pool":
        candidates.update({name: text for text, name in POOL_NAMES.items()})
    prompts = os.path.join(work, "prompts.yaml")
    with open(prompts, "w", encoding="utf-8") as f:
        yaml.safe_dump({"policy": {"active": "original", "candidates": candidates}}, f)
    bridge_port = free_port()
    with LocalServices(work) as services:
        receiver = services.start_receiver(os.path.join(work, "spanrl.db"))
        apo = ApoConfig(prompts=prompts, rounds=args.rounds, beam_width=2, branch_factor=2, batch_tasks=8,
                        gradient_batch=4, optimizer_max_tokens=64)
        if mode == "optimizer":
            port = free_port()
            server = services.start("optimizer", [sys.executable, "-m", "spanrl", "serve", model, "--port", str(port),
                                                  "--device", "cpu", "--served-model-name", "optimizer"])
            wait_for_port(port, server, "spanrl serve (the optimizer)", timeout_s=120)
            apo = ApoConfig(**{**apo.__dict__, "optimizer_url": f"http://127.0.0.1:{port}/v1",
                               "optimizer_model": "optimizer"})
        services.start_runner(AGENT, bridge_port, receiver, 8, "--bridge-wait-s", "300")
        settings = TrainSettings(
            tasks=tasks, val_tasks=val_tasks, val_attempts=args.val_attempts, model=model, algorithm="apo", apo=apo,
            output_dir=os.path.join(work, "run"), store=os.path.join(work, "spanrl.db"), reward=REWARD,
            device="cpu", seed=seed, policy_port=0, bridge_port=bridge_port, rollout_timeout_s=60, group_size=1)
        started = time.monotonic()
        run_training(settings, show_progress=False)
        seconds = time.monotonic() - started
    with open(os.path.join(work, "run", "apo.json"), encoding="utf-8") as f:
        record = json.load(f)[0]
    held_out = {c["name"]: c["held_out"] for c in record["candidates"]}
    return {"mode": mode, "seed": seed, "start_held_out": held_out.get("original"), "best": record["best"],
            "best_text": next(c["text"] for c in record["candidates"] if c["name"] == record["best"]),
            "best_held_out": held_out.get(record["best"]), "held_out": held_out,
            "proposed": sum(1 for c in record["candidates"] if c["parent"]), "dropped": len(record["dropped"]),
            "dropped_reasons": record["dropped"][:4], "seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-apo")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--val-attempts", type=int, default=4)
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    results = []
    for seed in args.seeds:
        root = os.path.join(args.out, f"seed{seed}")
        os.makedirs(root)
        model = warm_model(root, seed, args.sft_steps)
        for mode in ("optimizer", "pool"):
            results.append(search(mode, root, model, seed, args))
            print(json.dumps(results[-1]), flush=True)
    for pool_run in (r for r in results if r["mode"] == "pool" and r["start_held_out"] is None):
        # the starting prompt left the pool's beam unvalidated: its held-out score on the same model
        pool_run["start_held_out"] = next(r["start_held_out"] for r in results
                                          if r["mode"] == "optimizer" and r["seed"] == pool_run["seed"])
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    print("\n| seed | mode | held-out reward: start -> chosen | chosen | proposed / dropped | seconds |")
    print("|---|---|---|---|---|---|")
    for r in results:
        start, best = r["start_held_out"], r["best_held_out"]
        print(f"| {r['seed']} | {r['mode']} | {_shown(start)} -> {_shown(best)} | {r['best']} | "
              f"{r['proposed']} / {r['dropped']} | {r['seconds']:.0f} |")


def _shown(score: float | None) -> str:
    return "-" if score is None else f"{score:.2f}"


if __name__ == "__main__":
    main()
