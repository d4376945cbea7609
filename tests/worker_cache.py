"""Build an expensive test artefact (a warm-started model) once per test run, even when pytest-xdist
spreads the suite over several worker processes: the first worker to ask builds it under a file
lock in the run's shared temporary folder, the others wait and take its path.

Without xdist (``worker_id == "master"``) it is simply built in the session's own temp folder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def built_once(tmp_path_factory: pytest.TempPathFactory, worker_id: str, name: str,
               build: Callable[[Path], str]) -> str:
    """``build(folder)`` run once per test run; returns what it returned (a path, as text)."""
    if worker_id == "master":
        return build(tmp_path_factory.mktemp(name))
    shared_root = tmp_path_factory.getbasetemp().parent  # common to every worker of this run
    folder, done = shared_root / name, shared_root / f"{name}.done"
    with FileLock(str(shared_root / f"{name}.lock")):
        if not done.exists():
            folder.mkdir(exist_ok=True)
            done.write_text(build(folder))
        return done.read_text()
