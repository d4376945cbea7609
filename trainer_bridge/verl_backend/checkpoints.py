"""The verl backend's checkpoint folders: ``step-N/`` under the run's checkpoint folder, each with
the policy version and step beside verl's own actor checkpoint (``actor/``) or, with per-agent
adapters, the adapters in peft's format (``adapters/<name>/``, ``adapters.py``)."""

from __future__ import annotations

import json
import os
import shutil

VERSION_FILE = "spanrl_policy_version.json"
ADAPTERS_FOLDER = "adapters"  # a checkpoint's per-agent adapters (adapters.py), one peft folder each


def write_version(path: str, policy_version: int, step: int) -> None:
    """The policy version and step a checkpoint folder holds (what resuming continues from)."""
    with open(os.path.join(path, VERSION_FILE), "w") as f:
        json.dump({"policy_version": policy_version, "step": step}, f)


def latest_checkpoint(checkpoint_dir: str) -> tuple[str, int, int] | None:
    """The newest ``step-N`` checkpoint under ``checkpoint_dir``: (path, policy version, step)."""
    if not os.path.isdir(checkpoint_dir):
        return None
    steps = sorted(name for name in os.listdir(checkpoint_dir)
                   if name.startswith("step-") and os.path.exists(os.path.join(checkpoint_dir, name, VERSION_FILE)))
    if not steps:
        return None
    path = os.path.join(checkpoint_dir, steps[-1])
    with open(os.path.join(path, VERSION_FILE)) as f:
        saved = json.load(f)
    return path, int(saved["policy_version"]), int(saved["step"])


def prune_checkpoints(root: str, keep: int) -> None:
    """Delete all but the newest ``keep`` ``step-N`` checkpoints under ``root`` (0: keep all)."""
    steps = sorted(name for name in os.listdir(root) if name.startswith("step-")) if os.path.isdir(root) else []
    for name in steps[:-keep] if keep else []:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


__all__ = ["ADAPTERS_FOLDER", "VERSION_FILE", "latest_checkpoint", "prune_checkpoints", "write_version"]
