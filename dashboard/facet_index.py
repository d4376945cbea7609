"""The dashboard's own index of what the rollouts page filters and sorts on inside rollout bodies.

A rollout's status, the sum of its reward events and its agents' names live only in its JSON
body (``assembled.body``); filtering 10^5 rollouts on them would read every body (seconds) on
every request, and sorting by reward would look up two tables per rollout. So the dashboard
keeps them, once per rollout, in an SQLite file of its own (a temporary folder; never the
store, which it only reads): ``facets`` (status, event reward, the reward shown, task, step)
and ``facet_agents`` (agent name -> rollout), indexed. A background thread (``FacetIndexer``,
started by ``app.py``) reads new assembled rollouts in ``sequence`` order, a batch at a time
(an assembled rollout never changes), and new ``trained_rollouts`` rows by rowid; it starts
over when the store was replaced. Queries attach the file read-only (``attach``) and read
rollouts after ``indexed_sequence`` from the store itself, so a page is right while the index
catches up (a reward the trainer recorded since the last pass shows one pass later).
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import tempfile
import threading

from .store_reader import StoreProblem, open_store, step_of_rollout

logger = logging.getLogger(__name__)

BATCH = 2000
SCHEMA = """
CREATE TABLE IF NOT EXISTS facets (
    sequence     INTEGER PRIMARY KEY,   -- the rollout's assembled.sequence in the store
    rollout_id   TEXT NOT NULL UNIQUE,
    status       TEXT,
    event_reward REAL,
    task_id      TEXT,
    step         INTEGER,               -- its round's step (store_reader.step_of_rollout), NULL if none
    reward       REAL                   -- the reward shown: the trained one, else event_reward
);
CREATE INDEX IF NOT EXISTS facets_by_status ON facets (status);
CREATE INDEX IF NOT EXISTS facets_by_task ON facets (task_id);
CREATE INDEX IF NOT EXISTS facets_by_step ON facets (step);
-- the store's trained_rollouts rewards, followed by rowid (a rollout scored again gets a new one)
CREATE TABLE IF NOT EXISTS trained (rollout_id TEXT PRIMARY KEY, reward REAL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS facet_agents (
    agent      TEXT NOT NULL,
    rollout_id TEXT NOT NULL,
    PRIMARY KEY (agent, rollout_id)
) WITHOUT ROWID;
"""
# What one batch reads from the store: SQLite's JSON functions pick the facets out of each body.
READ_BATCH = (
    "SELECT sequence, rollout_id, json_extract(body, '$.status'), json_extract(body, '$.total_reward'),"
    " json_extract(body, '$.task_id'),"
    " (SELECT group_concat(name, char(31)) FROM (SELECT DISTINCT json_extract(j.value, '$.agent_name') AS name"
    "  FROM json_each(body, '$.transitions') j WHERE name IS NOT NULL))"
    " FROM assembled WHERE sequence > ? AND body != '' ORDER BY sequence LIMIT ?"
)


class FacetIndex:
    """The index file and the store it indexes; ``catch_up`` adds what the store assembled since."""

    def __init__(self, store_path: str, folder: str) -> None:
        self.store_path = store_path
        self.path = os.path.join(folder, "facets.db")
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)
        self.indexed_sequence = self._last()
        self.trained_rowid = 0  # the last trained_rollouts rowid read (the file is new at each start)

    def _last(self) -> int:
        return int(self.db.execute("SELECT coalesce(max(sequence), 0) FROM facets").fetchone()[0])

    def _store_replaced(self, store: sqlite3.Connection) -> bool:
        """The last rollout indexed is not in the store under its sequence any more."""
        if self.indexed_sequence == 0:
            return False
        at = (self.indexed_sequence,)
        indexed = self.db.execute("SELECT rollout_id FROM facets WHERE sequence = ?", at).fetchone()
        stored = store.execute("SELECT rollout_id FROM assembled WHERE sequence = ?", at).fetchone()
        return stored is None or indexed is None or stored[0] != indexed[0]

    def catch_up(self, max_batches: int | None = None) -> int:
        """Index rollouts assembled since the last call; returns how many. A store that cannot be
        read (not there yet, not spanrl's) indexes nothing."""
        try:
            reader = open_store(self.store_path)
        except StoreProblem:
            return 0
        added = 0
        with reader:
            if self._store_replaced(reader.db):
                logger.info("the store %s was replaced: indexing it again", self.store_path)
                self.db.executescript("DELETE FROM facets; DELETE FROM facet_agents; DELETE FROM trained;")
                self.indexed_sequence = self.trained_rowid = 0
            if reader.trained:
                added += self._follow_trained(reader.db)
            batches = 0
            while max_batches is None or batches < max_batches:
                rows = reader.db.execute(READ_BATCH, (self.indexed_sequence, BATCH)).fetchall()
                if not rows:
                    break
                self._add(rows)
                added += len(rows)
                batches += 1
        return added

    def _follow_trained(self, store: sqlite3.Connection) -> int:
        rows = store.execute("SELECT rowid, rollout_id, reward FROM trained_rollouts WHERE rowid > ? ORDER BY rowid",
                             (self.trained_rowid,)).fetchall()
        if rows:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT OR REPLACE INTO trained VALUES (?, ?)", [(r, v) for _, r, v in rows])
            self.db.executemany("UPDATE facets SET reward = ? WHERE rollout_id = ?", [(v, r) for _, r, v in rows])
            self.db.execute("COMMIT")
            self.trained_rowid = rows[-1][0]
        return len(rows)

    def _add(self, rows: list[tuple]) -> None:
        facets: list[tuple] = []
        agents: list[tuple[str, str]] = []
        ids = [row[1] for row in rows]
        trained = dict(self.db.execute(
            f"SELECT rollout_id, reward FROM trained WHERE rollout_id IN ({','.join('?' * len(ids))})", ids))
        for sequence, rollout_id, status, reward, task_id, names in rows:
            found = step_of_rollout(rollout_id)
            facets.append((sequence, rollout_id, status, reward, task_id, None if found is None else found[1],
                           trained.get(rollout_id, reward)))
            agents.extend((name, rollout_id) for name in (names.split("\x1f") if names else ()))
        self.db.execute("BEGIN")
        self.db.executemany("INSERT OR REPLACE INTO facets VALUES (?, ?, ?, ?, ?, ?, ?)", facets)
        self.db.executemany("INSERT OR IGNORE INTO facet_agents VALUES (?, ?)", agents)
        self.db.execute("COMMIT")
        self.indexed_sequence = rows[-1][0]

    def close(self) -> None:
        self.db.close()


class FacetIndexer:
    """Keeps a ``FacetIndex`` up to date in a daemon thread, every ``interval_s``."""

    def __init__(self, store_path: str, interval_s: float) -> None:
        self.folder = tempfile.mkdtemp(prefix="spanrl-dashboard-")
        self.index = FacetIndex(store_path, self.folder)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spanrl-dashboard-index", daemon=True)

    def start(self) -> FacetIndexer:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.index.catch_up()
            except sqlite3.Error as exc:  # e.g. the store is busy or being replaced: try again later
                logger.warning("indexing the store %s: %s (will retry)", self.index.store_path, exc)
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.index.close()
        shutil.rmtree(self.folder, ignore_errors=True)
