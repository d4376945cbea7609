"""Task datasets: a JSONL file of task objects, each with its id.

``spanrl train`` (the training loop, its validation rounds, the warm start from a store) reads
``tasks`` and ``val_tasks`` files with ``load_tasks``; a task's id is its ``id`` (or ``task_id``)
field, else its position in the file. Stdlib only.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from spanrl.errors import UserError


class Task(NamedTuple):
    """One task of a dataset: its id and the JSON object the agent gets (unpacks as a pair)."""

    task_id: str
    task: dict[str, Any]


def task_id_of(task: dict, index: int) -> str:
    """The id of ``task``, the ``index``-th of its file: its ``id`` or ``task_id`` field, else ``index``."""
    return str(task.get("id", task.get("task_id", index)))


def load_tasks(path: str) -> list[Task]:
    """The tasks of a JSONL file; bad lines are named in the error."""
    tasks: list[Task] = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    task = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path}:{number}: not JSON: {exc}") from exc
                if not isinstance(task, dict):
                    raise UserError(f"{path}:{number}: a task must be a JSON object")
                tasks.append(Task(task_id_of(task, len(tasks)), task))
    except FileNotFoundError as exc:
        raise UserError(f"task file not found: {path}") from exc
    if not tasks:
        raise UserError(f"task file {path} holds no tasks")
    return tasks
