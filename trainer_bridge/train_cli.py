"""``spanrl train CONFIG``: the trainer bridge sidecar (settings in train_settings.py).

Registered by ``core/cli.py``, which builds ``TrainSettings`` (flags > ``OTEL_SPANRL_TRAIN_*``
> the YAML file > defaults), prints them and calls ``train_command``. Bad settings, files and
ports raise ``spanrl.errors.UserError``: one line and exit 2.
"""

from __future__ import annotations

import argparse

from spanrl.settings_loader import CommandSettings

from .train_settings import TrainSettings

SETTINGS = CommandSettings("train", TrainSettings, "TRAIN", config_positional=True)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="the trainer bridge: hand out tasks, read rollouts, GRPO, publish weights",
        description="Hand out tasks to runners, read completed rollouts from the receiver's "
        "store, run GRPO and publish new weights to the embedded policy server. The torch "
        "trainer and the policy engine are set in the 'trainer:' and 'engine:' blocks.",
    )
    SETTINGS.add_to(parser)
    parser.set_defaults(func=train_command)


def train_command(settings: TrainSettings) -> int:
    from .session import run_training

    summary = run_training(settings)
    if settings.val_only:
        from .validation import validation_summary

        print(validation_summary(summary["validation"]))
        return 0
    print(training_summary(summary))
    return 0


def training_summary(summary: dict) -> str:
    """What ``spanrl train`` prints at the end: how it went and where the results are."""
    lines = ["spanrl train: finished"]
    if summary["steps"]:
        lines[0] += (f" {summary['steps']} steps (policy version {summary['policy_version']}); reward "
                     f"{summary['first_reward']:.2f} -> {summary['last_reward']:.2f}, best "
                     f"{summary['best_reward']:.2f} at step {summary['best_step']}")
    places = {"checkpoints": summary["checkpoints"], "last checkpoint": summary["checkpoint"],
              "metrics": summary["metrics"], "plot": summary["plot"], **summary.get("trackers", {})}
    width = max(len(name) for name in places)
    lines += [f"  {name + ':':<{width + 1}} {where}" for name, where in places.items()]
    flat = summary.get("tasks_without_signal")
    if flat:
        lines.append("  tasks whose rollouts all scored the same, nothing to learn from: "
                     + "; ".join(f"{len(ids)} scored {score} ({_some(ids)})" for score, ids in sorted(flat.items())))
    return "\n".join(lines)


def _some(ids: list[str], shown: int = 5) -> str:
    return ", ".join(ids[:shown]) + (f", +{len(ids) - shown} more" if len(ids) > shown else "")
