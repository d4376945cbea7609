"""Does training make the agents better on tasks they have not seen? Held-out accuracy per arm.

For each task (``sql_agent``: LangGraph, writer + rewriter trained; ``retrieval_qa``: OpenAI Agents
SDK; ``calc_autogen``: AutoGen AgentChat, in ``.venv-autogen``) and each seed: one local model
warm-started on the task's demonstrations, then every arm trained from that same warm model with
the same number of rollouts (``steps x tasks_per_step x group_size``), its held-out accuracy
(greedy, ``val.jsonl``, never trained on) measured after the warm start and every ``--val-every``
steps. Arms:

- ``warm``: the warm start alone (its accuracy, step 0);
- ``grpo``: GRPO;
- ``sft``: SFT from rollouts (``algorithm: sft``: the rollouts that scored 1 are learned by NLL);
- ``reinforce_plus_plus``: GRPO's update with the batch as baseline (``advantage_estimator:
  reinforce_plus_plus``): a task whose rollouts all succeeded is still pushed up, as SFT keeps it;
- ``grpo_no_air``: the receiver's AIR rules off (the tasks that have rules: SQL, the calculator);
- SQL ablations: ``grpo_identical`` (credit ``identical`` instead of ``discounted``),
  ``grpo_all_agents`` (the checker trained too);
- ``grpo_graded``: GRPO trained on the task's graded reward (retrieval QA: ``search_reward``, part
  of the reward for each entity of the question's chain its searches reached; until 2026-12-05
  ``chain_reward``, for an answer on the chain), validated on its exact match as every arm is;
- ``grpo_graded_calls``: GRPO on the task's per-call rewards (retrieval QA: ``search_step_rewards``,
  the answer judged by exact match alone, each search by what it found) with ``advantage_level:
  transition``, so each call's advantage comes from its own return.

With ``--repeats N`` each arm is trained N times from each warm start (runs differ: the agents'
threads and timings are not replayed), its accuracy is the mean of its repeats, and each task's
section compares every arm with ``sft`` and ``grpo`` run by run (ahead / level / behind, the sign
test): one run's result moves by up to 0.15 between identical runs (docs/results.md).

The report (tables, plot, the sections of ``docs/results.md``) is ``learning_report.py``.
Writes ``results.json``, one PNG per task (mean over seeds, spread shaded) into ``--output-dir``
and, with ``--results FILE``, each measured task's section (command, machine, plot, table) into the
block between the markers of FILE (``docs/results.md``); the other tasks' sections stay, so tasks can
be measured one run at a time::

    python bench/learning.py --seeds 0 1 2 --steps 10 --results docs/results.md
    python bench/learning.py --quick            # 1-2 steps of each arm: checks that everything runs

Plan on minutes per step on a 2-core CPU (most of it the agents' rollouts).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # learning_report, beside this file

from learning_report import kinds_text, over_repeats, plot, summarise, table, write_results  # noqa: E402

from spanrl.schema import metrics as keys

ARMS = ("grpo", "sft", "reinforce_plus_plus", "grpo_no_air", "grpo_identical", "grpo_all_agents", "grpo_graded",
        "grpo_graded_calls")
SQL_ONLY_ARMS = ("grpo_identical", "grpo_all_agents")  # grpo_no_air: any task with AIR rules
TASKS = ("sql_agent", "retrieval_qa", "calc_autogen")


def load_task(name: str):
    if name == "sql_agent":
        from spanrl.examples.sql_agent.pipeline import TASK
    elif name == "retrieval_qa":
        from spanrl.examples.retrieval_qa.pipeline import TASK
    elif name == "calc_autogen":
        from spanrl.examples.calc_autogen.pipeline import TASK, check_autogen_venv

        check_autogen_venv()
    else:
        raise SystemExit(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    return TASK


def arm_run(arm: str, base, task_name: str):
    """The ``TrainingRun`` of ``arm`` (``base`` is the GRPO run)."""
    if arm == "sft":
        return replace(base, algorithm="sft", learning_rate=base.settings.get("sft_learning_rate", base.learning_rate),
                       settings={k: v for k, v in base.settings.items() if k != "sft_learning_rate"})
    settings = {k: v for k, v in base.settings.items() if k != "sft_learning_rate"}
    if arm == "reinforce_plus_plus":
        return replace(base, settings={**settings, "advantage_estimator": "reinforce_plus_plus"})
    if arm == "grpo_no_air":
        return replace(base, air=False, settings=settings)
    if arm == "grpo_identical":
        return replace(base, credit="identical", settings={**settings, "advantage_level": "rollout"})
    if arm == "grpo_all_agents":
        return replace(base, agents=(), settings=settings)
    if arm == "grpo_graded":  # trained on the task's graded reward, validated on its own
        task = load_task(task_name)
        return replace(base, settings={**settings, "reward": task.graded_reward, "val_reward_fn": task.reward})
    if arm == "grpo_graded_calls":  # the task's per-call rewards, each on the call that earned it
        task = load_task(task_name)
        return replace(base, settings={**settings, "reward": task.graded_call_reward, "val_reward_fn": task.reward,
                                       "advantage_level": "transition"})
    return replace(base, settings=settings)


def arm_applies(arm: str, task) -> bool:
    """Whether ``arm`` means something on ``task`` (an ablation of a part the task does not have does not)."""
    if arm in SQL_ONLY_ARMS:
        return task.name == "sql_agent"
    if arm == "grpo_no_air":
        return task.air_rules != "off"
    if arm == "grpo_graded_calls":
        return task.graded_call_reward is not None
    return arm != "grpo_graded" or task.graded_reward is not None


def validation_subset(task, count: int, out: Path) -> str:
    """The first ``count`` validation tasks in a file of their own (``--quick``)."""
    lines = Path(task.val_tasks).read_text(encoding="utf-8").splitlines()[:count]
    path = out / f"{task.name}-val-{count}.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def run_seed(task, seed: int, args: argparse.Namespace, out: Path) -> dict:
    from spanrl.examples.task_pipeline import TrainingRun, held_out_accuracy, held_out_by_kind, prepare_model

    seed_dir = out / task.name / f"seed-{seed}"
    val_tasks = validation_subset(task, args.val_subset, out) if args.val_subset else None
    started = time.monotonic()
    warm = replace(task.warm_start, preset=args.preset, steps=args.sft_steps or task.warm_start.steps,
                   batch_size=args.sft_batch_size or task.warm_start.batch_size, seed=seed, device=args.device,
                   share=args.share, learning_rate=args.sft_learning_rate)
    if args.reuse_warm_start:  # an earlier run's warm start of this task and seed
        warm_dir = str(Path(args.reuse_warm_start).resolve() / task.name / f"seed-{seed}" / "model" / "model-warm")
        if not (Path(warm_dir) / "config.json").exists():
            raise SystemExit(f"--reuse-warm-start: no warm model at {warm_dir}")
        print(f"{task.name} seed {seed}: reusing the warm start in {warm_dir}", flush=True)
    else:
        print(f"{task.name} seed {seed}: warm start, {warm.steps} SFT steps of {warm.batch_size}", flush=True)
        # its progress shows (a line every 30 s in a log): on the small preset it runs for an hour
        warm_dir = prepare_model(task, str(seed_dir / "model"), warm, progress=True)
    warm_accuracy = held_out_accuracy(task, warm_dir, str(seed_dir / "warm-validation"), seed=seed,
                                      device=args.device, concurrency=args.concurrency, val_tasks=val_tasks)
    result: dict = {"warm": {"accuracy": {0: warm_accuracy}, "seconds": time.monotonic() - started,
                             "sft": (f"reused from {args.reuse_warm_start}" if args.reuse_warm_start
                                     else f"{warm.steps} SFT steps of {warm.batch_size}")}}
    result["warm"]["by_kind"] = held_out_by_kind(task, str(seed_dir / "warm-validation"), val_tasks)
    print(f"{task.name} seed {seed}: warm start {warm_accuracy:.3f} ({result['warm']['seconds']:.0f} s)"
          f"{kinds_text(result['warm']['by_kind'])}", flush=True)
    extra = arm_settings(args)
    base = TrainingRun(output_dir="", model_dir=warm_dir, steps=args.steps, group_size=args.group_size,
                       tasks_per_step=args.tasks_per_step, learning_rate=args.learning_rate,
                       val_every=args.val_every, concurrency=args.concurrency, seed=seed, device=args.device,
                       val_tasks=val_tasks, settings=extra)
    for arm in args.arms:
        if not arm_applies(arm, task):
            continue
        from spanrl.examples.task_pipeline import train

        runs = []
        for repeat in range(args.repeats):  # each repeat trains the arm again from the same warm start
            name = arm if repeat == 0 else f"{arm}-repeat{repeat + 1}"
            started = time.monotonic()
            training = replace(arm_run(arm, base, task.name), output_dir=str(seed_dir / name))
            summary = train(task, training, progress=False)
            rows = summary["rows"]
            runs.append({"accuracy": {0: warm_accuracy, **summary["accuracy"]}, "seconds": time.monotonic() - started,
                         "training": what_trained(training),
                         "train_reward": [r[keys.REWARD_MEAN] for r in rows],
                         "rollouts": sum(r[keys.ROLLOUTS] for r in rows),
                         "by_kind": held_out_by_kind(task, summary["output_dir"], val_tasks)})
            curve = " ".join(f"{s}:{a:.2f}" for s, a in runs[-1]["accuracy"].items())
            print(f"{task.name} seed {seed} {name}: {curve} ({runs[-1]['seconds']:.0f} s)"
                  f"{kinds_text(runs[-1]['by_kind'])}", flush=True)
        result[arm] = over_repeats(runs)
    return result


def what_trained(training) -> dict:
    """What makes one arm's run what it is (``learning_report.pooled_seeds`` pools only runs that
    agree on it): algorithm, budget, learning rate, AIR, credit, trained agents, extra settings."""
    keep = ("algorithm", "steps", "group_size", "tasks_per_step", "learning_rate", "air", "credit", "agents",
            "settings")
    # through JSON and back: as results.json will hold it (tuples as lists), so records compare alike
    return json.loads(json.dumps({key: getattr(training, key) for key in keep}, default=str))


def arm_settings(args: argparse.Namespace) -> dict:
    """The train settings every arm shares: ``--settings``, the SFT arm's learning rate, and
    ``max_empty_steps: 0`` unless ``--settings`` sets it. The arms are compared at the same number
    of rollouts, so an arm that has nothing to learn for a while (SFT from rollouts before any
    rollout succeeds) samples on with the others instead of stopping the whole run with an error."""
    extra = dict(json.loads(args.settings)) if args.settings else {}
    if args.sft_arm_learning_rate is not None:
        extra["sft_learning_rate"] = args.sft_arm_learning_rate
    extra.setdefault("max_empty_steps", 0)
    return extra


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS,
                        help="arms trained from each warm start (none: the warm start's accuracy only)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--val-every", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1,
                        help="train each arm this many times from each warm start (runs are not replayed exactly: "
                             "threads and timings differ); accuracy is their mean, and each arm is compared "
                             "with sft and grpo run by run")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--sft-arm-learning-rate", type=float, default=None,
                        help="the sft arm's learning rate (default: --learning-rate)")
    parser.add_argument("--sft-steps", type=int, default=None, help="warm-start SFT steps (default: the task's)")
    parser.add_argument("--sft-batch-size", type=int, default=None,
                        help="warm-start SFT batch size (default: the task's)")
    parser.add_argument("--sft-learning-rate", type=float, default=1e-3, help="warm-start SFT learning rate")
    parser.add_argument("--share", type=float, default=None,
                        help="the demonstrations' share of the weaker behaviour (default: each task's)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--settings", default="",
                        help="more train settings as JSON, e.g. '{\"kl_coef\": 0.01}' or "
                             "'{\"trainer\": {\"ppo_epochs\": 4}}'")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--val-subset", type=int, default=0, help="score only the first N validation tasks")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output-dir", default="runs/learning")
    parser.add_argument("--results", default="", help="write the table into this markdown file (docs/results.md)")
    parser.add_argument("--machine-note", default="the machine's load not recorded")
    parser.add_argument("--reuse-warm-start", default="", metavar="DIR",
                        help="train from the warm starts an earlier run left in its --output-dir DIR (same task and "
                             "seed; its SFT settings are not checked) instead of building them again")
    parser.add_argument("--quick", action="store_true",
                        help="1 seed, 2 steps of 2 tasks x 2 rollouts, 30 SFT steps of 8, 4 validation tasks: checks "
                             "that every arm runs (its figures mean nothing)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be 1 or more")
    if args.quick:
        args.seeds, args.steps, args.val_every, args.tasks_per_step, args.group_size = [0], 2, 1, 2, 2
        args.sft_steps, args.sft_batch_size, args.val_subset, args.concurrency = 30, 8, args.val_subset or 4, 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = "python bench/learning.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    results: dict = {"settings": vars(args), "command": command, "tasks": {}}
    for task_name in args.tasks:
        task = load_task(task_name)
        per_seed = {seed: run_seed(task, seed, args, out) for seed in args.seeds}
        summary = summarise(per_seed)
        results["tasks"][task_name] = {"seeds": per_seed, "summary": summary}
        plot(task_name, summary, out / f"learning-{task_name}.png")
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    sections = table(results, args, command)
    print("\n\n".join(sections.values()))
    if args.results:
        results_path = Path(args.results)
        figures = results_path.parent / "results"
        figures.mkdir(parents=True, exist_ok=True)
        for task_name in results["tasks"]:
            (figures / f"learning-{task_name}.png").write_bytes((out / f"learning-{task_name}.png").read_bytes())
        write_results(results_path, sections)
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
