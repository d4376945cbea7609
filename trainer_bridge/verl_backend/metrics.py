"""verl's metrics of an actor update as spanrl's: one float per key, ``actor/`` dropped.

Called by ``backend.VerlBackend`` (the GRPO update) and ``sft_update`` (the SFT step). verl-free.
"""

from __future__ import annotations

from typing import Any


def flatten_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """verl's per-micro-batch metric lists as one float each (their mean); ``actor/`` dropped."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        plain = [getattr(v, "value", v) for v in values]  # verl's Metric objects carry .value
        numbers = [float(v) for v in plain if isinstance(v, int | float)]
        if numbers:
            flat[key.removeprefix("actor/")] = sum(numbers) / len(numbers)
    return flat
