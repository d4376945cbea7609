"""A run's ``metrics.jsonl``, read into one row type whatever the key names of its writer.

Called by the dashboard's run and validation pages (``pages.py``). ``read_metrics`` is the one
place the dashboard reads metrics: it accepts today's flat keys (``reward_mean``, ``pg_loss``,
``rollouts_left_out: {reason: n}``) and verl-style namespaced ones (``rollout/reward_mean``,
``actor/pg_loss``, ``timing/...``, flattened ``.../left_out/<reason>``), so a run written
before or after the rename reads the same. A line the trainer is still writing (or any line
that is not a JSON object) is skipped and named in ``problems``; the other rows are kept.
Stdlib only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

METRICS_FILE = "metrics.jsonl"

# The dashboard's name of each number -> the keys a metrics row may carry it under, in order.
# A key not listed is also found by its last path segment (``anything/pg_clipfrac``).
KEY_NAMES: dict[str, tuple[str, ...]] = {
    "policy_version": ("policy_version", "actor/policy_version", "training/policy_version"),
    "reward_mean": ("reward_mean", "rollout/reward_mean", "critic/score/mean"),
    "reward_std": ("reward_std", "rollout/reward_std", "critic/score/std"),
    "val_reward": ("val_reward", "val/reward", "val/reward_mean", "val/score"),
    "loss": ("loss", "actor/loss"),
    "pg_loss": ("pg_loss", "actor/pg_loss"),
    "kl_loss": ("kl_loss", "actor/kl_loss", "actor/kl"),
    "ppo_kl": ("ppo_kl", "actor/ppo_kl"),
    "pg_clipfrac": ("pg_clipfrac", "actor/pg_clipfrac"),
    "rollouts_per_s": ("rollouts_per_s", "rollout/rollouts_per_s", "timing/rollouts_per_s", "perf/rollouts_per_s"),
    "rollouts": ("rollouts", "rollout/rollouts", "rollout/count"),
    "rollouts_used": ("rollouts_used", "rollout/rollouts_used", "rollout/used"),
    "transitions": ("transitions", "rollout/transitions"),
    "val_rollouts": ("val_rollouts", "val/rollouts"),
    "val_rollouts_scored": ("val_rollouts_scored", "val/rollouts_scored"),
    "seconds": ("seconds", "timing/step", "timing/step_seconds"),
}
# Where the counts of left-out rollouts by reason live: a dict under one of these keys, or flat
# keys "<one of these>/<reason>".
LEFT_OUT_KEYS = ("rollouts_left_out", "rollout/left_out", "rollout/rollouts_left_out")
VAL_LEFT_OUT_KEYS = ("val_rollouts_left_out", "val/left_out", "val/rollouts_left_out")


@dataclass(frozen=True)
class StepMetrics:
    """One step of a run as the dashboard shows it; ``None``: the row did not carry that number."""

    step: int
    values: dict[str, float]
    left_out: dict[str, int] = field(default_factory=dict)
    val_left_out: dict[str, int] = field(default_factory=dict)

    def get(self, name: str) -> float | None:
        return self.values.get(name)


@dataclass(frozen=True)
class RunMetrics:
    """What ``metrics.jsonl`` holds: its rows in step order, and lines that could not be read."""

    path: str
    exists: bool
    rows: tuple[StepMetrics, ...]
    problems: tuple[str, ...]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _find(row: dict[str, Any], name: str) -> float | None:
    for key in KEY_NAMES.get(name, (name,)):
        if key in row:
            return _number(row[key])
    legacy = KEY_NAMES.get(name, (name,))[0]
    for key, value in row.items():  # a namespace the table does not know yet
        if "/" in key and key.rsplit("/", 1)[1] == legacy and not key.startswith("val"):
            return _number(value)
    return None


def _counts(row: dict[str, Any], keys: tuple[str, ...]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for key in keys:
        nested = row.get(key)
        if isinstance(nested, dict):
            counts.update({str(k): int(v) for k, v in nested.items() if _number(v) is not None})
        prefix = key + "/"
        for flat, value in row.items():
            if flat.startswith(prefix) and _number(value) is not None:
                counts[flat[len(prefix):]] = int(value)
    return counts


def step_metrics(row: dict[str, Any]) -> StepMetrics | None:
    """One metrics row in the dashboard's names; ``None`` when it has no step number."""
    step = _number(row.get("step", row.get("training/global_step")))
    if step is None:
        return None
    values = {name: value for name in KEY_NAMES if (value := _find(row, name)) is not None}
    return StepMetrics(int(step), values, _counts(row, LEFT_OUT_KEYS), _counts(row, VAL_LEFT_OUT_KEYS))


def read_metrics(output_dir: str) -> RunMetrics:
    """The rows of ``output_dir/metrics.jsonl`` (none when the file is not there yet)."""
    path = os.path.join(output_dir, METRICS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return RunMetrics(path, False, (), ())
    except (OSError, UnicodeDecodeError) as exc:
        return RunMetrics(path, True, (), (f"cannot read {path}: {exc}",))
    rows: dict[int, StepMetrics] = {}
    problems: list[str] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            if number < len(lines):  # the last line may still be being written
                problems.append(f"{path}:{number}: not JSON, skipped")
            continue
        parsed = step_metrics(data) if isinstance(data, dict) else None
        if parsed is None:
            problems.append(f"{path}:{number}: not a metrics row (no step), skipped")
            continue
        rows[parsed.step] = parsed  # a resumed run rewrites a step: the last row of it counts
    return RunMetrics(path, True, tuple(rows[s] for s in sorted(rows)), tuple(problems))
