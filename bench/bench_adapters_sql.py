"""One LoRA adapter per agent vs one shared model, on the Text-to-SQL example (issue 26, item 5).

For each seed: one local model warm-started on the example's demonstrations (``prepare_model``),
its greedy held-out accuracy (``held_out_accuracy``), then two arms trained from that same warm
model with the same number of rollouts (``steps x tasks_per_step x group_size``), both with the
writer and rewriter trained (the example's ``agents``) and every LangGraph node asking for its own
model name (``SQL_AGENT_MODEL_PER_NODE=1``, so the arms differ only in what serves and trains):

- ``shared``:   one set of weights trained on both agents' calls (the default);
- ``adapters``: ``adapters: {writer: {agents: [writer]}, rewriter: {agents: [rewriter]}}`` on a
  frozen base (the checker is served by the base in both arms: it is never trained).

Each arm runs in a child process (this script with ``--arm``), so its peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss``: the trainer, the engine and the loop; the HTTP front end
and the receiver and runner are other processes) is its own. Also reported: the trainer's torch
bytes, counted on a ``TorchTrainer`` of the same settings: every parameter, plus the gradient and
AdamW's two moments of each trainable one (float32). Held-out accuracy is greedy, the
``execution_match`` event over the validation file (``--val-subset N``: its first N), after the
last step.

Then serving: the HTTP policy server (``serve_in_process``, the one ``spanrl serve`` and
``spanrl train`` use) over one engine serving the base alone, 1 adapter, and 3 adapters taken in
turn (``bench_adapter_serving.py``'s model and adapters), ``--clients`` concurrent real ``openai``
clients each sending chat completions of ``--max-tokens`` tokens (end of sequence ignored):
generated tokens/s, median over ``--repeat`` rounds.

    python bench/bench_adapters_sql.py --seeds 0 1 --steps 3 --val-subset 8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_adapter_serving, learning

ADAPTERS = {"writer": {"agents": ["writer"]}, "rewriter": {"agents": ["rewriter"]}}
ARMS = {"shared": {}, "adapters": {"adapters": ADAPTERS}}
RUNNER_ENV = {"SQL_AGENT_MODEL_PER_NODE": "1"}


def arm_settings(arm: str, args: argparse.Namespace) -> dict:
    """The arm's extra train settings; ``--adapter-learning-rate`` gives each adapter its own rate."""
    if arm != "adapters" or args.adapter_learning_rate is None:
        return dict(ARMS[arm])
    rate = args.adapter_learning_rate
    return {"adapters": {name: {**spec, "learning_rate": rate} for name, spec in ADAPTERS.items()}}


def train_arm(args: argparse.Namespace) -> dict:
    """``--arm``: one arm's training run in this process; its accuracy, peak RSS and torch bytes."""
    from spanrl.examples.sql_agent.pipeline import train
    from spanrl.examples.task_pipeline import TrainingRun
    from spanrl.schema import metrics as keys

    started = time.monotonic()
    summary = train(TrainingRun(output_dir=args.arm_dir, model_dir=args.warm_dir, steps=args.steps,
                                group_size=args.group_size, tasks_per_step=args.tasks_per_step,
                                learning_rate=args.learning_rate, val_every=args.steps, concurrency=args.concurrency,
                                seed=args.seed, device=args.device, val_tasks=args.val_tasks or None,
                                runner_env=RUNNER_ENV, settings=arm_settings(args.arm, args)), progress=False)
    rows = summary["rows"]
    return {"accuracy": summary["accuracy"], "seconds": time.monotonic() - started,
            "rollouts": sum(r[keys.ROLLOUTS] for r in rows),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "adapter_samples": {k: [r.get(f"actor/adapter/{k}/samples", 0) for r in rows] for k in ADAPTERS}}


def torch_bytes(model_dir: str, arm: str) -> dict:
    """Parameters, and gradients + AdamW moments of the trainable ones, of the arm's trainer (MiB)."""
    from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

    trainer = TorchTrainer(model_dir, TrainerConfig(device="cpu", **ARMS[arm]))
    if arm == "adapters":
        from spanrl.trainer_bridge.torch_backend.multi_adapter import adapter_parameters

        trainable = [p for name in ADAPTERS for p in adapter_parameters(trainer.model, name)]
    else:
        trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    training = sum(p.numel() * 4 * 3 for p in trainable)  # gradient + AdamW's exp_avg and exp_avg_sq
    mib = 1024 * 1024
    return {"params_mib": params / mib, "grad_and_optimizer_mib": training / mib,
            "trainable_params": sum(p.numel() for p in trainable)}


def run_arm_process(arm: str, seed: int, warm_dir: str, seed_dir: Path, val_tasks: str,
                    args: argparse.Namespace) -> dict:
    out = seed_dir / f"{arm}.json"
    command = [sys.executable, __file__, "--arm", arm, "--seed", str(seed), "--warm-dir", warm_dir,
               "--arm-dir", str(seed_dir / arm), "--arm-out", str(out), "--val-tasks", val_tasks,
               "--steps", str(args.steps), "--group-size", str(args.group_size),
               "--tasks-per-step", str(args.tasks_per_step), "--learning-rate", str(args.learning_rate),
               "--concurrency", str(args.concurrency), "--device", args.device]
    if args.adapter_learning_rate is not None:
        command += ["--adapter-learning-rate", str(args.adapter_learning_rate)]
    subprocess.run(command, check=True)
    return dict(json.loads(out.read_text()))


def run_seed(seed: int, args: argparse.Namespace, out: Path) -> dict:
    from learning import validation_subset

    from spanrl.examples.sql_agent.pipeline import TASK, prepare_model
    from spanrl.examples.task_pipeline import WarmStart, held_out_accuracy

    seed_dir = out / f"seed-{seed}"
    val_tasks = validation_subset(TASK, args.val_subset, out) if args.val_subset else ""
    warm_dir = prepare_model(str(seed_dir / "model"), WarmStart(preset=args.preset, steps=args.sft_steps, seed=seed,
                                                                device=args.device), progress=False)
    warm = held_out_accuracy(TASK, warm_dir, str(seed_dir / "warm-validation"), seed=seed, device=args.device,
                             concurrency=args.concurrency, val_tasks=val_tasks or None)
    print(f"seed {seed}: warm start accuracy {warm:.3f}", flush=True)
    result: dict = {"warm": warm}
    for arm in ARMS:
        result[arm] = run_arm_process(arm, seed, warm_dir, seed_dir, val_tasks, args)
        result[arm]["torch"] = torch_bytes(warm_dir, arm)
        final = list(result[arm]["accuracy"].values())[-1]
        print(f"seed {seed} {arm}: accuracy {final:.3f}, peak RSS {result[arm]['peak_rss_mib']:.0f} MiB, "
              f"{result[arm]['rollouts']} rollouts, {result[arm]['seconds']:.0f} s", flush=True)
    return result


def http_tokens_per_second(model_dir: str, weights: dict, names: tuple[str, ...], args: argparse.Namespace) -> float:
    """Generated tokens/s through the HTTP server, the ``--clients`` openai clients in a process of
    their own (``client_load``), so the engine's process holds none of their threads."""
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process

    engine = PolicyEngine.from_pretrained(model_dir, device="cpu", dtype="float32", model_name="policy")
    if names:
        engine.attach_adapters({name: weights[name] for name in names}, {name: (name,) for name in names})
    engine.eos_ids = set()  # every request runs its max_tokens: the same work in every set-up
    engine.start()
    server = serve_in_process(engine, "127.0.0.1", 0)
    try:
        command = [sys.executable, __file__, "--load-url", str(server.base_url), "--load-models",
                   ",".join(names) or "policy", "--clients", str(args.clients), "--http-requests",
                   str(args.http_requests), "--max-tokens", str(args.max_tokens)]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        return float(done.stdout.strip().splitlines()[-1])
    finally:
        server.stop()
        engine.stop()


def client_load(args: argparse.Namespace) -> float:
    """``--load-url``: ``--clients`` concurrent openai clients, each sending its share of
    ``--http-requests`` chat completions (models of ``--load-models`` in turn); tokens/s."""
    import openai

    names = args.load_models.split(",")
    per_client = args.http_requests // args.clients
    generated = [0] * args.clients

    def client(number: int) -> None:
        api = openai.OpenAI(base_url=args.load_url, api_key="unused", max_retries=0, timeout=600)
        for request in range(per_client):
            reply = api.chat.completions.create(
                model=names[(number + request) % len(names)], max_tokens=args.max_tokens, temperature=1.0,
                messages=[{"role": "user", "content": f"Question {number}-{request}: what is {request} + 1?"}])
            generated[number] += reply.usage.completion_tokens if reply.usage else 0

    client(0)  # warm-up
    generated[0] = 0
    threads = [threading.Thread(target=client, args=(n,)) for n in range(args.clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(generated) / (time.perf_counter() - started)


def serving(args: argparse.Namespace) -> dict:
    from bench_adapter_serving import SETUPS, exported_adapters

    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

    rates: dict[str, list[float]] = {label: [] for label in SETUPS}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(create_model_dir(f"{tmp}/model", preset=args.serve_preset, seed=0))
        weights = exported_adapters(model_dir, 8)
        for round_number in range(args.repeat):
            for label, names in SETUPS.items():
                rates[label].append(http_tokens_per_second(model_dir, weights, names, args))
                print(f"serving round {round_number + 1}: {label:<10} {rates[label][-1]:8.1f} tok/s", flush=True)
    return {label: {"median": statistics.median(r), "min": min(r), "max": max(r)} for label, r in rates.items()}


def report(results: dict) -> str:
    lines = ["| arm | seed | warm acc | final acc | rollouts | peak RSS (MiB) | torch params + grad/AdamW (MiB) "
             "| trainable params | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for seed, result in results["seeds"].items():
        for arm in ARMS:
            data = result[arm]
            final = list(data["accuracy"].values())[-1]
            t = data["torch"]
            lines.append(f"| {arm} | {seed} | {result['warm']:.3f} | {final:.3f} | {data['rollouts']} | "
                         f"{data['peak_rss_mib']:.0f} | {t['params_mib']:.1f} + {t['grad_and_optimizer_mib']:.1f} | "
                         f"{t['trainable_params']} | {data['seconds']:.0f} |")
    if results.get("serving"):
        base = results["serving"]["base"]["median"]
        lines += ["", "| serving through HTTP | tok/s (median) | min | max | ratio to base |", "|---|---|---|---|---|"]
        for label, data in results["serving"].items():
            lines.append(f"| {label} | {data['median']:.1f} | {data['min']:.1f} | {data['max']:.1f} | "
                         f"{data['median'] / base:.2f}x |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--adapter-learning-rate", type=float, default=None,
                        help="the adapters' learning rate (default: --learning-rate, the shared model's)")
    parser.add_argument("--sft-steps", type=int, default=200, help="warm-start SFT steps")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--val-subset", type=int, default=0, help="score only the first N validation tasks")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--serve-preset", default="small", help="the serving measurement's model")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--http-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-training", action="store_true", help="the serving measurement only")
    parser.add_argument("--skip-serving", action="store_true", help="the training arms only")
    parser.add_argument("--output-dir", default="runs/bench_adapters_sql")
    # one arm in a child process (run_arm_process)
    parser.add_argument("--arm", choices=tuple(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--warm-dir", help=argparse.SUPPRESS)
    parser.add_argument("--arm-dir", help=argparse.SUPPRESS)
    parser.add_argument("--arm-out", help=argparse.SUPPRESS)
    parser.add_argument("--val-tasks", default="", help=argparse.SUPPRESS)
    parser.add_argument("--load-url", help=argparse.SUPPRESS)  # the client load's process (client_load)
    parser.add_argument("--load-models", default="policy", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.arm:
        Path(args.arm_out).write_text(json.dumps(train_arm(args), default=str))
        return 0
    if args.load_url:
        print(client_load(args))
        return 0
    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"command": "python bench/bench_adapters_sql.py " + " ".join(sys.argv[1:]),
                     "cpu_count": os.cpu_count(), "seeds": {}}
    if not args.skip_training:
        for seed in args.seeds:
            results["seeds"][seed] = run_seed(seed, args, out)
            (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    if not args.skip_serving:
        results["serving"] = serving(args)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(results["command"])
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
