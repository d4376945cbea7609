"""What the trainer trained each rollout with: its reward, where the reward came from, the returns.

The receiver's store knows the rewards the agent emitted (and AIR's), but not a reward function's
value, which only ``spanrl train`` computes. After each step the training loop writes one
``TrainedRollout`` per scored rollout into the table ``trained_rollouts`` of the same SQLite
store (``record``); ``spanrl inspect`` reads them back (``load``) to show the reward every rollout
was trained with, whatever its source, and the return each transition was trained with;
``spanrl dashboard`` also shows each transition's GRPO advantage (``advantages``, a column added
later: a table without it gains it at the next ``record``, and its old rows read as None).
Stdlib only; a store without the table (no training yet) reads as empty.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS trained_rollouts (
    rollout_id    TEXT PRIMARY KEY,
    step          INTEGER NOT NULL,   -- the training step (1-based, as in metrics.jsonl)
    reward        REAL NOT NULL,      -- the rollout's score in GRPO
    reward_source TEXT NOT NULL,      -- 'reward function M:F', or 'events: spanrl.reward, air:...'
    returns       TEXT NOT NULL,      -- JSON list: the return of each trained transition, by index
    used          INTEGER NOT NULL,   -- 0: scored but left out of the update (a group of one)
    recorded_at   REAL NOT NULL,
    advantages    TEXT                -- JSON {index: GRPO advantage} of each trained transition; NULL: none
)
"""
ADD_ADVANTAGES = "ALTER TABLE trained_rollouts ADD COLUMN advantages TEXT"
BUSY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TrainedRollout:
    """One rollout as the trainer scored it. ``returns`` maps transition index -> return;
    ``advantages`` transition index -> the group advantage it was trained with (None: not
    recorded, e.g. rejection-sampling SFT, or a store written before the column existed)."""

    rollout_id: str
    step: int
    reward: float
    reward_source: str
    returns: dict[int, float]
    used: bool
    advantages: dict[int, float] | None = None


def _connect(path: str | Path) -> sqlite3.Connection:
    return sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None)


def record(store_path: str | Path, rollouts: Iterable[TrainedRollout]) -> None:
    """Save ``rollouts`` (a rollout scored again replaces its row) in one transaction."""
    rows = [
        (r.rollout_id, r.step, r.reward, r.reward_source,
         json.dumps({str(index): value for index, value in r.returns.items()}), int(r.used), time.time(),
         None if r.advantages is None else json.dumps({str(i): a for i, a in r.advantages.items()}))
        for r in rollouts
    ]
    if not rows:
        return
    db = _connect(store_path)
    try:
        db.execute(SCHEMA)
        db.execute("BEGIN IMMEDIATE")
        if "advantages" not in _columns(db):  # a table made before the column existed
            db.execute(ADD_ADVANTAGES)
        db.executemany("INSERT OR REPLACE INTO trained_rollouts (rollout_id, step, reward, reward_source,"
                       " returns, used, recorded_at, advantages) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        db.execute("COMMIT")
    finally:
        db.close()


def load(store_path: str | Path) -> dict[str, TrainedRollout]:
    """Every recorded rollout by id; empty when the trainer never wrote to this store."""
    db = _connect(store_path)
    try:
        found = db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'trained_rollouts'").fetchone()
        if found is None:
            return {}
        advantages = "advantages" if "advantages" in _columns(db) else "NULL"
        rows = db.execute(
            f"SELECT rollout_id, step, reward, reward_source, returns, used, {advantages} FROM trained_rollouts"
        ).fetchall()
    finally:
        db.close()
    return {
        rollout_id: TrainedRollout(rollout_id, step, reward, source,
                                   {int(k): float(v) for k, v in json.loads(returns).items()}, bool(used),
                                   None if advantage_json is None
                                   else {int(k): float(v) for k, v in json.loads(advantage_json).items()})
        for rollout_id, step, reward, source, returns, used, advantage_json in rows
    }


def _columns(db: sqlite3.Connection) -> set[str]:
    return {row[1] for row in db.execute("PRAGMA table_info(trained_rollouts)")}
