"""A run's ``metrics.jsonl``, read into one row type whatever the key names of its writer.

Called by the dashboard's run and validation pages (``pages.py``). ``read_metrics`` is the one
place the dashboard reads metrics. Rows go through ``spanrl.schema.metrics.namespaced`` (the
project's one table of old key names), so a run written before the metric keys were namespaced
reads the same as one written after. Unlike ``spanrl.schema.metrics.read_metrics``, it is
tolerant: a line the trainer is still writing (or any line that is not a JSON object) is
skipped and named in ``problems``; the other rows are kept. Stdlib only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from spanrl.schema import metrics as keys

METRICS_FILE = "metrics.jsonl"

# The dashboard's name of each number -> its key in a (namespaced) metrics row.
KEY_NAMES: dict[str, str] = {
    "policy_version": keys.POLICY_VERSION,
    "reward_mean": keys.REWARD_MEAN,
    "reward_std": "rollout/reward_std",  # not written by spanrl train today: the band comes from the store
    "val_reward": keys.VAL_REWARD,
    "loss": keys.actor_key("loss"),
    "pg_loss": keys.actor_key("pg_loss"),
    "kl_loss": keys.actor_key("kl_loss"),
    "ppo_kl": keys.actor_key("ppo_kl"),
    "pg_clipfrac": keys.actor_key("pg_clipfrac"),
    "rollouts_per_s": keys.ROLLOUTS_PER_S,
    "rollouts": keys.ROLLOUTS,
    "rollouts_used": keys.ROLLOUTS_USED,
    "transitions": keys.TRANSITIONS,
    "val_rollouts": keys.VAL_ROLLOUTS,
    "val_rollouts_scored": keys.VAL_ROLLOUTS_SCORED,
    "seconds": keys.STEP_SECONDS,
}


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


def _counts(value: Any) -> dict[str, int]:
    """``{reason: count}`` of a left-out dict (anything else: none)."""
    if not isinstance(value, dict):
        return {}
    return {str(k): int(v) for k, v in value.items() if _number(v) is not None}


def step_metrics(row: dict[str, Any]) -> StepMetrics | None:
    """One metrics row in the dashboard's names; ``None`` when it has no step number."""
    row = keys.namespaced(row)
    step = _number(row.get(keys.STEP))
    if step is None:
        return None
    values = {name: value for name, key in KEY_NAMES.items() if (value := _number(row.get(key))) is not None}
    return StepMetrics(int(step), values, _counts(row.get(keys.ROLLOUTS_LEFT_OUT)),
                       _counts(row.get(keys.VAL_LEFT_OUT)))


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
