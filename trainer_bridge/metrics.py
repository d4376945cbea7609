"""Training metrics: ``metrics.jsonl`` (one JSON object per step) and the reward-curve PNG
(the mean reward per step, and the validation reward where a validation round scored the
held-out tasks). The row keys and the reader of old files are ``spanrl.schema.metrics``."""

from __future__ import annotations

import json
import os

from spanrl.schema import metrics as keys


class MetricsLog:
    """Appends one line per step; ``plot()`` redraws ``reward_curve.png`` from all of them."""

    def __init__(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.plot_path = os.path.join(output_dir, "reward_curve.png")
        self.rows: list[dict] = []
        if os.path.exists(self.path):  # a resumed run keeps its history (an older run's keys renamed)
            self.rows = keys.read_metrics(self.path)

    def keep_up_to_version(self, policy_version: int) -> None:
        """Drop rows after ``policy_version`` (a resumed run redoes the steps after its
        checkpoint, so they must not appear twice)."""
        kept = [r for r in self.rows if r.get(keys.POLICY_VERSION, 0) <= policy_version]
        if len(kept) != len(self.rows):
            self.rows = kept
            with open(self.path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)

    def append(self, row: dict) -> None:
        row = keys.namespaced(row)
        self.rows.append(row)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def plot(self) -> str | None:
        return plot_rewards(self.rows, self.plot_path)


def plot_rewards(rows: list[dict], path: str) -> str | None:
    """Draw the reward per step of ``rows`` (today's keys) into the PNG ``path``; None without rows."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r[keys.STEP] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, [r[keys.REWARD_MEAN] for r in rows], marker="o", label="reward_mean")
    validated = [r for r in rows if keys.VAL_REWARD in r]
    if validated:  # the held-out score, at the steps it was taken
        ax.plot([r[keys.STEP] for r in validated], [r[keys.VAL_REWARD] for r in validated], marker="s",
                linestyle="--", label="val_reward")
        ax.legend(loc="best")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward")
    values = [r[keys.REWARD_MEAN] for r in rows] + [r[keys.VAL_REWARD] for r in validated]
    ax.set_ylim(-0.05, 1.05) if all(0 <= v <= 1 for v in values) else None
    ax.grid(alpha=0.3)
    ax.set_title("spanrl: reward per step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
