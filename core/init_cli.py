"""``spanrl init DIR``: scaffold a project that trains an agent of your own with spanrl.

Registered by ``core/cli.py``, which builds ``InitSettings`` and calls ``init_command``. The
project's files are those of ``examples/own_agent/`` (installed as ``spanrl.examples.own_agent``):
a plain OpenAI-client agent, a reward function, ``train.yaml``, ``run.yaml`` and a README; then
its ``make_data.py`` writes ``tasks.jsonl`` and ``demonstrations.jsonl`` in the new folder. With
``spanrl model init`` and ``spanrl sft`` it trains out of the box on the embedded backend.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import resources

from spanrl.errors import UserError
from spanrl.settings_loader import CommandSettings

TEMPLATE_PACKAGE = "spanrl.examples.own_agent"
TEMPLATE_FILES = ("agent.py", "reward.py", "make_data.py", "train.yaml", "run.yaml", "README.md")
GITIGNORE = "model/\nmodel-warm/\nruns/\nspanrl.db*\n__pycache__/\n"


@dataclass(frozen=True)
class InitSettings:
    dir: str = field(metadata={"help": "the project folder to create", "positional": True})
    force: bool = field(default=False, metadata={"help": "write into a non-empty folder, replacing its files"})
    seed: int = field(default=0, metadata={"help": "seed of the generated tasks and demonstrations"})


SETTINGS = CommandSettings("init", InitSettings, "INIT")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "init",
        help="create a project to train your own agent: agent, reward, tasks, demonstrations, configs",
        description="Create DIR with a small agent (plain OpenAI client), its reward function, tasks, "
        "demonstrations for the warm start, train.yaml, run.yaml and a README of the commands that "
        "train it. Replace the agent, reward and data with yours.",
    )
    SETTINGS.add_to(parser)
    parser.set_defaults(func=init_command)


def init_command(settings: InitSettings) -> int:
    target = os.path.abspath(settings.dir)
    if os.path.exists(target) and not os.path.isdir(target):
        raise UserError(f"{settings.dir} exists and is not a folder")
    if os.path.isdir(target) and os.listdir(target) and not settings.force:
        raise UserError(f"{settings.dir} is not empty: choose a new folder, or pass --force to write into it")
    os.makedirs(target, exist_ok=True)
    template = resources.files(TEMPLATE_PACKAGE)
    for name in TEMPLATE_FILES:
        with resources.as_file(template / name) as source:
            shutil.copyfile(source, os.path.join(target, name))
    with open(os.path.join(target, ".gitignore"), "w", encoding="utf-8") as f:
        f.write(GITIGNORE)
    # the project's own script writes its data: the user can rerun or change it
    made = subprocess.run([sys.executable, "make_data.py", str(settings.seed)], cwd=target,
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise RuntimeError(f"make_data.py failed in {target}:\n{made.stderr}")
    shown = settings.dir.rstrip("/") or "."
    print(f"created {shown}: {', '.join(TEMPLATE_FILES)}, tasks.jsonl, demonstrations.jsonl\n"
          f"next: cd {shown} and follow README.md (model init, sft, receive, train, run)")
    return 0
