"""``spanrl eval``'s numbers: per-task results, greedy accuracy and the unbiased pass@k estimator.

``pass_at_k(n, c, k)`` is the estimator of Chen et al. (2021, "Evaluating Large Language Models
Trained on Code"): with ``n`` samples of a task of which ``c`` succeed, the chance that at least one
of ``k`` samples drawn without replacement succeeds, ``1 - C(n - c, k) / C(n, k)``, computed as a
product so large ``n`` does not overflow. A sample succeeds when its score is at least the success
threshold; a sample that could not be scored (failed, timed out, no reward, a failed judge) counts as
not succeeding, and so does a task whose greedy rollout could not be scored. Called by
``evaluation.py``; stdlib only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a task with ``n`` samples, ``c`` of them successes (``k <= n``)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    failing_all = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
        failing_all *= 1.0 - k / i
    return 1.0 - failing_all


@dataclass(frozen=True)
class TaskResult:
    """One task's results: its greedy rollout and its ``n`` sampled ones."""

    task_id: str
    greedy_score: float | None  # None: the greedy rollout could not be scored (greedy_left_out says why)
    greedy_success: bool
    sample_scores: list[float]  # the scored samples' scores
    samples: int  # sampled attempts (scored or not)
    successes: int
    pass_at_k: float | None  # None without samples
    greedy_left_out: str | None = None
    samples_left_out: dict[str, int] = field(default_factory=dict)
    greedy_rollout: str | None = None  # the greedy rollout's id (spanrl inspect rollout ID)


@dataclass(frozen=True)
class EvalSummary:
    """What ``spanrl eval`` writes to its JSON file."""

    target: str  # the model directory or the endpoint URL evaluated
    tasks_file: str
    tasks: int
    k: int
    samples_per_task: int
    success_threshold: float
    greedy_accuracy: float | None  # None when no greedy round ran
    pass_at_k: float | None  # None without samples
    mean_greedy_reward: float | None
    mean_sample_reward: float | None
    left_out: dict[str, int]
    seconds: float
    results: list[TaskResult]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def greedy_accuracy(results: Sequence[TaskResult]) -> float:
    """The fraction of tasks whose greedy rollout's reward reached the success threshold."""
    return sum(r.greedy_success for r in results) / len(results)


def mean_pass_at_k(results: Sequence[TaskResult]) -> float | None:
    """The mean pass@k over the tasks (None when no task was sampled)."""
    values = [r.pass_at_k for r in results if r.pass_at_k is not None]
    return sum(values) / len(values) if values else None


def summary_table(summary: EvalSummary, max_rows: int = 15) -> str:
    """One screen: the totals, then a row per task (the first ``max_rows``)."""
    k = summary.k

    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [f"spanrl eval: {summary.target} on {summary.tasks} tasks of {summary.tasks_file}",
             f"  greedy accuracy {number(summary.greedy_accuracy)}   pass@{k} {number(summary.pass_at_k)} "
             f"({summary.samples_per_task} samples per task)   success: reward >= {summary.success_threshold:g}",
             f"  mean reward: greedy {number(summary.mean_greedy_reward)}, sampled {number(summary.mean_sample_reward)}"
             + (f"   left out: {', '.join(f'{n} {c}' for n, c in sorted(summary.left_out.items()))}"
                if summary.left_out else "")]
    width = max([4] + [len(r.task_id) for r in summary.results[:max_rows]])
    lines.append(f"  {'task':<{width}}  greedy  ok  samples ok  pass@{k}")
    for r in summary.results[:max_rows]:
        greedy = r.greedy_left_out or number(r.greedy_score)
        lines.append(f"  {r.task_id:<{width}}  {greedy:>6}  {'y' if r.greedy_success else 'n':>2}  "
                     f"{r.successes:>4}/{r.samples:<4}  {number(r.pass_at_k)}")
    if len(summary.results) > max_rows:
        lines.append(f"  ... {len(summary.results) - max_rows} more tasks in the JSON file")
    return "\n".join(lines)
