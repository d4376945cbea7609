"""``spanrl train CONFIG``: the trainer bridge sidecar (settings in train_settings.py)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from spanrl.settings_loader import add_settings_flags

    from .train_settings import TrainSettings

    parser = subparsers.add_parser(
        "train",
        help="the trainer bridge: hand out tasks, read rollouts, GRPO, publish weights",
        description="Hand out tasks to runners, read completed rollouts from the receiver's "
        "store, run GRPO and publish new weights to the embedded policy server.",
    )
    parser.add_argument("config", nargs="?", help="YAML file of training settings")
    add_settings_flags(parser, TrainSettings, "TRAIN")
    parser.set_defaults(func=train_command)


def train_command(args: argparse.Namespace) -> int:
    import logging

    from spanrl.env_settings import SettingError
    from spanrl.settings_loader import describe_settings, load_settings

    from .train_settings import TrainSettings
    from .training_loop import run_training

    try:
        settings = load_settings(TrainSettings, "TRAIN", args.config, args)
    except (SettingError, ValueError) as exc:
        print(f"spanrl train: {exc}")
        return 2
    logging.getLogger("spanrl.trainer_bridge").info(
        "training settings:\n%s", describe_settings(settings))
    try:
        summary = run_training(settings)
    except ValueError as exc:
        print(f"spanrl train: {exc}")
        return 2
    if summary["steps"]:
        print(f"reward {summary['first_reward']:.2f} -> {summary['last_reward']:.2f} "
              f"over {summary['steps']} steps; policy version {summary['policy_version']}")
    print(f"metrics: {summary['metrics']}\nplot: {summary['plot']}\ncheckpoint: {summary['checkpoint']}")
    return 0
