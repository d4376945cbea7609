"""Training metrics: ``metrics.jsonl`` (one JSON object per step) and the reward-curve PNG
(``reward_mean`` per step, and ``val_reward`` where a validation round scored the held-out tasks)."""

from __future__ import annotations

import json
import os


class MetricsLog:
    """Appends one line per step; ``plot()`` redraws ``reward_curve.png`` from all of them."""

    def __init__(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.plot_path = os.path.join(output_dir, "reward_curve.png")
        self.rows: list[dict] = []
        if os.path.exists(self.path):  # a resumed run keeps its history
            with open(self.path, encoding="utf-8") as f:
                self.rows = [json.loads(line) for line in f if line.strip()]

    def keep_up_to_version(self, policy_version: int) -> None:
        """Drop rows after ``policy_version`` (a resumed run redoes the steps after its
        checkpoint, so they must not appear twice)."""
        kept = [r for r in self.rows if r.get("policy_version", 0) <= policy_version]
        if len(kept) != len(self.rows):
            self.rows = kept
            with open(self.path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)

    def append(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def plot(self) -> str | None:
        if not self.rows:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.rows]
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        ax.plot(steps, [r["reward_mean"] for r in self.rows], marker="o", label="reward_mean")
        validated = [r for r in self.rows if "val_reward" in r]
        if validated:  # the held-out score, at the steps it was taken
            ax.plot([r["step"] for r in validated], [r["val_reward"] for r in validated], marker="s",
                    linestyle="--", label="val_reward")
            ax.legend(loc="best")
        ax.set_xlabel("training step")
        ax.set_ylabel("mean reward")
        values = [r["reward_mean"] for r in self.rows] + [r["val_reward"] for r in validated]
        ax.set_ylim(-0.05, 1.05) if all(0 <= v <= 1 for v in values) else None
        ax.grid(alpha=0.3)
        ax.set_title("spanrl: reward per step")
        fig.tight_layout()
        fig.savefig(self.plot_path)
        plt.close(fig)
        return self.plot_path
