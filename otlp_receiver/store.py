"""The durable span store: SQLite (stdlib ``sqlite3``) in WAL mode.

Written by the receiver (``ingest.py`` commits each batch of Export requests in one
transaction before they are acknowledged; the assembler saves assembled rollouts) and read by
the trainer bridge and ``spanrl inspect``, possibly from other processes at the same time::

    store = SpanStore("spanrl.db")
    rollouts, cursor = store.completed_rollouts(since=0)   # oldest first

Durability: ``synchronous=FULL`` (the default) fsyncs the write-ahead log on every commit, so an
acknowledged span survives kill -9 *and* power loss. ``NORMAL`` survives kill -9 (the commit is
in the OS page cache before the call returns) but a power cut may lose the last commits; it
is available as ``sync="normal"`` for throughput when that risk is acceptable.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from operator import itemgetter
from pathlib import Path

from spanrl.otlp_receiver.otlp_decode import SpanRow
from spanrl.otlp_receiver.span_writes import (
    RejectedSpan,
    assembled_among,
    count_new_spans,
    insert_group,
    pending_completions_among,
    refuse_late,
)
from spanrl.otlp_receiver.store_schema import SCHEMA
from spanrl.schema.rollouts import (
    END_EXPLICIT,
    END_IDLE_TIMEOUT,
    END_ROLLOUT_SPAN,
    AssembledRollout,
    rollout_from_dict,
    rollout_to_dict,
)

logger = logging.getLogger(__name__)
_START_NS = itemgetter(3)  # a span row's start time (``rollout_spans``)

SYNC_MODES = ("full", "normal", "extra")
# An explicit completion for a rollout none of whose spans arrived yet is kept this long for
# them (the agent's exporter may still be flushing); it never creates an empty rollout.
PENDING_COMPLETION_TTL_S = 3600.0
# ... and at most this many are kept (clients choose the ids): past it, the oldest are dropped
MAX_PENDING_COMPLETIONS = 10_000
STORE_FILE_MODE = 0o600  # spans hold prompts and answers: only the owner reads the store
COMPLETION_REQUESTED = "requested"
COMPLETION_PENDING = "pending"
COMPLETION_ALREADY_ASSEMBLED = "already_assembled"
BUSY_TIMEOUT_MS = 60_000

class StoreError(RuntimeError):
    """The store could not be opened or written (locked, disk full, I/O): a retry may pass."""


def describe_write_error(exc: sqlite3.Error) -> str:
    """SQLite's message plus its error name and, for a failed write, what to check."""
    name = getattr(exc, "sqlite_errorname", "")
    text = f"{exc} ({name})" if name else str(exc)
    if name.startswith(("SQLITE_FULL", "SQLITE_IOERR")):
        text += ("; is the disk full or a file-size limit reached? nothing of this batch was stored;"
                 " it is refused as retryable until the store can write again")
    return text


@dataclass(frozen=True)
class RolloutSummary:
    """One row of ``spanrl inspect rollouts``: a rollout, open or assembled."""

    rollout_id: str
    task_id: str | None
    attempt: int | None
    state: str
    span_count: int
    first_seen: float
    last_seen: float
    late_spans: int
    assembled: AssembledRollout | None


@dataclass(frozen=True)
class ReadyRollout:
    rollout_id: str
    end_reason: str


@dataclass(frozen=True)
class StoredSpan:
    trace_id: bytes
    span_id: bytes
    body: bytes


def _create_owner_only(path: Path) -> None:
    """Create the store file readable by its owner only (an empty file is an empty SQLite
    database); SQLite gives its -wal and -shm files the database file's permissions. An
    existing store keeps the permissions its owner gave it."""
    if path.exists() or str(path) == ":memory:":
        return
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, STORE_FILE_MODE))


class SpanStore:
    """Spans, rollouts and assembled transitions in one SQLite file (created owner-only). Thread-safe."""

    def __init__(self, path: str | Path = "spanrl.db", sync: str = "full") -> None:
        if sync not in SYNC_MODES:
            raise StoreError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
        self.path = Path(path)
        self._lock = threading.RLock()
        self.new_spans = 0  # spans this connection added (a retried span already stored is not counted)
        try:
            _create_owner_only(self.path)
            self._db = sqlite3.connect(
                str(self.path), timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                check_same_thread=False,
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={sync.upper()}")
            self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open span store {self.path}: {exc}") from exc
        self._create_schema()

    def _create_schema(self) -> None:
        with self._lock:
            try:
                self._db.executescript(SCHEMA)
            except sqlite3.Error as exc:
                raise StoreError(f"cannot create the schema of {self.path}: {exc}") from exc

    class _Tx:
        def __init__(self, store: SpanStore) -> None:
            self.store = store

        def __enter__(self):
            self.store._lock.acquire()
            try:
                self.store._db.execute("BEGIN IMMEDIATE")
            except BaseException:
                self.store._lock.release()
                raise
            return self.store._db

        def __exit__(self, exc_type, exc, tb):
            try:
                if exc_type is None:
                    self.store._db.execute("COMMIT")
                else:
                    self.store._db.execute("ROLLBACK")
            finally:
                self.store._lock.release()
            return False

    def _transaction(self) -> SpanStore._Tx:
        return SpanStore._Tx(self)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> SpanStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- writing (the receiver) -------------------------------------------------------------

    def write_spans(self, rows: Sequence[SpanRow], now: float | None = None) -> list[RejectedSpan]:
        """Store ``rows`` in one transaction; spans already stored are left as they are.

        When this returns, the spans are committed (durable as ``sync`` says), except those it
        returns as rejected, one by one with the reason: a span of a rollout that was already
        assembled (``ROLLOUT_ALREADY_ASSEMBLED``), or a span SQLite cannot hold (a value out of
        its range). Raises ``StoreError`` when the store itself fails (locked, disk full, I/O):
        nothing was written then, and a retry may pass.
        """
        if not rows:
            return []
        now = time.time() if now is None else now
        # Rows grouped by rollout: ``INSERT OR IGNORE`` skips spans already stored (exporter
        # retries), so each group's inserted count is read from the connection's change
        # counter and only spans actually inserted count towards the rollout's bookkeeping
        # (span_count, late_spans, last_seen; a retry must not restart the grace delay).
        per_rollout: dict[str, list[tuple[int, SpanRow]]] = {}
        for index, row in enumerate(rows):
            per_rollout.setdefault(row.rollout_id or "", []).append((index, row))
        rejected: list[RejectedSpan] = []
        added = 0
        try:
            with self._transaction() as db:
                named = [r for r in per_rollout if r]
                assembled = assembled_among(db, named)
                pending = pending_completions_among(db, named)
                for rollout_id, group in per_rollout.items():
                    if rollout_id in assembled:
                        refuse_late(db, rollout_id, group, rejected)
                        continue
                    stored, inserted = insert_group(db, rollout_id, group, now, rejected)
                    added += inserted
                    if rollout_id and inserted:
                        count_new_spans(db, rollout_id, stored, inserted, now, pending.get(rollout_id))
                        if rollout_id in pending:
                            db.execute("DELETE FROM pending_completions WHERE rollout_id = ?", (rollout_id,))
        except sqlite3.Error as exc:
            raise StoreError(f"cannot write {len(rows)} spans to {self.path}: {describe_write_error(exc)}") from exc
        self.new_spans += added
        return rejected

    def complete_rollout(self, rollout_id: str, now: float | None = None) -> str:
        """Ask for ``rollout_id`` to be assembled (after the grace delay) by the receiver.

        Returns what happened: ``COMPLETION_REQUESTED`` (an open rollout; assembled after the
        grace delay), ``COMPLETION_ALREADY_ASSEMBLED`` (nothing to do), or
        ``COMPLETION_PENDING``: no span of it arrived yet (the agent's exporter may still be
        flushing), so no rollout is created; the request is kept for ``PENDING_COMPLETION_TTL_S``
        and applies when its first spans arrive."""
        now = time.time() if now is None else now
        try:
            with self._transaction() as db:
                row = db.execute("SELECT state FROM rollouts WHERE rollout_id = ?", (rollout_id,)).fetchone()
                if row is None:
                    db.execute("DELETE FROM pending_completions WHERE requested_at < ?",
                               (now - PENDING_COMPLETION_TTL_S,))
                    db.execute("INSERT OR IGNORE INTO pending_completions (rollout_id, requested_at)"
                               " VALUES (?, ?)", (rollout_id, now))
                    db.execute("DELETE FROM pending_completions WHERE rollout_id IN (SELECT rollout_id FROM"
                               " pending_completions ORDER BY requested_at DESC LIMIT -1 OFFSET ?)",
                               (MAX_PENDING_COMPLETIONS,))
                    return COMPLETION_PENDING
                if row[0] == "assembled":
                    return COMPLETION_ALREADY_ASSEMBLED
                db.execute(
                    "UPDATE rollouts SET completion_requested_at = coalesce(completion_requested_at, ?)"
                    " WHERE rollout_id = ?", (now, rollout_id))
                return COMPLETION_REQUESTED
        except sqlite3.Error as exc:
            raise StoreError(f"cannot record completion of rollout {rollout_id!r} in {self.path}: {exc}") from exc

    def rollouts_ready(
        self,
        now: float,
        grace_s: float,
        idle_timeout_s: float | None,
        on_rollout_span: bool = True,
    ) -> list[ReadyRollout]:
        """Open rollouts whose end has been seen and that were quiet for ``grace_s``."""
        with self._lock:
            rows = self._db.execute(
                "SELECT rollout_id, last_seen, root_seen_at, completion_requested_at"
                " FROM rollouts WHERE state = 'open'"
            ).fetchall()
        ready: list[ReadyRollout] = []
        for rollout_id, last_seen, root_seen_at, requested_at in rows:
            triggers = []
            if requested_at is not None:
                triggers.append((requested_at, END_EXPLICIT))
            if on_rollout_span and root_seen_at is not None:
                triggers.append((root_seen_at, END_ROLLOUT_SPAN))
            if triggers:
                first_at, reason = min(triggers)
                if now - max(first_at, last_seen) >= grace_s:
                    ready.append(ReadyRollout(rollout_id, reason))
                    continue
            if idle_timeout_s is not None and idle_timeout_s > 0 and now - last_seen >= idle_timeout_s:
                ready.append(ReadyRollout(rollout_id, END_IDLE_TIMEOUT))
        return ready

    def save_assembled(self, rollout: AssembledRollout, now: float | None = None) -> AssembledRollout:
        """Save an assembled rollout and mark it done; returns it with its ``sequence``."""
        now = time.time() if now is None else now
        with self._transaction() as db:
            cursor = db.execute(
                "INSERT INTO assembled (rollout_id, assembled_at, body) VALUES (?, ?, '')"
                " ON CONFLICT (rollout_id) DO NOTHING",
                (rollout.rollout_id, now),
            )
            if cursor.rowcount == 0:
                raise StoreError(f"rollout {rollout.rollout_id!r} was already assembled")
            sequence = cursor.lastrowid
            saved = replace(rollout, sequence=int(sequence))
            db.execute(
                "UPDATE assembled SET body = ? WHERE sequence = ?",
                (json.dumps(rollout_to_dict(saved)), sequence),
            )
            db.execute(
                "UPDATE rollouts SET state = 'assembled' WHERE rollout_id = ?",
                (rollout.rollout_id,),
            )
        return saved

    def mark_broken(self, rollout_id: str, reason: str) -> None:
        """Assembly of ``rollout_id`` failed unexpectedly: stop retrying it, keep its spans."""
        with self._transaction() as db:
            db.execute(
                "UPDATE rollouts SET state = 'broken', broken_reason = ? WHERE rollout_id = ?",
                (reason, rollout_id),
            )

    # --- reading (the trainer bridge, inspect, the assembler) -------------------------------

    def completed_rollouts(self, since: int = 0, limit: int | None = None) -> tuple[list[AssembledRollout], int]:
        """Assembled rollouts with ``sequence > since``, oldest first, and the next cursor."""
        query = "SELECT sequence, body FROM assembled WHERE sequence > ? ORDER BY sequence"
        params: tuple = (int(since),)
        if limit is not None:
            query += " LIMIT ?"
            params += (int(limit),)
        with self._lock:
            rows = self._db.execute(query, params).fetchall()
        rollouts = [rollout_from_dict(json.loads(body)) for _, body in rows]
        cursor = rows[-1][0] if rows else int(since)
        return rollouts, cursor

    def assembled_rollout(self, rollout_id: str) -> AssembledRollout | None:
        with self._lock:
            row = self._db.execute(
                "SELECT body FROM assembled WHERE rollout_id = ?", (rollout_id,)
            ).fetchone()
        return None if row is None else rollout_from_dict(json.loads(row[0]))

    def rollout_summaries(self) -> list[RolloutSummary]:
        with self._lock:
            rows = self._db.execute(
                "SELECT r.rollout_id, r.task_id, r.attempt, r.state, r.span_count, r.first_seen,"
                " r.last_seen, r.late_spans, a.body FROM rollouts r"
                " LEFT JOIN assembled a ON a.rollout_id = r.rollout_id ORDER BY r.first_seen"
            ).fetchall()
        return [
            RolloutSummary(
                rollout_id=r[0], task_id=r[1], attempt=r[2], state=r[3], span_count=r[4],
                first_seen=r[5], last_seen=r[6], late_spans=r[7],
                assembled=None if r[8] is None else rollout_from_dict(json.loads(r[8])),
            )
            for r in rows
        ]

    def rollout_spans(self, rollout_id: str) -> list[StoredSpan]:
        """Every span of a rollout: those carrying its id, plus spans without any rollout id
        that share a trace with it (e.g. from a service that did not stamp the identity); in
        start order."""
        return [StoredSpan(trace_id, span_id, body) for trace_id, span_id, body, _ in self._rollout_rows(rollout_id)]

    def rollout_bodies(self, rollout_id: str) -> list[bytes]:
        """The serialized bodies of ``rollout_spans``, in the same order (what assembly reads)."""
        return [row[2] for row in self._rollout_rows(rollout_id)]

    def _rollout_rows(self, rollout_id: str) -> list[tuple[bytes, bytes, bytes, int]]:
        with self._lock:
            # rows by rowid (the order they were written: the table's own order), not in the
            # unique index's (random span ids): a 100k-span rollout's table pages are then read
            # once each, in order, instead of at random (2.9 -> 1.4 us a span, measured)
            rows = self._db.execute(
                "SELECT trace_id, span_id, body, start_ns FROM spans"
                " WHERE rowid IN (SELECT rowid FROM spans WHERE rollout_id = ?)"
                " UNION ALL SELECT s.trace_id, s.span_id, s.body, s.start_ns FROM spans s"
                " WHERE s.rollout_id = '' AND s.trace_id IN"
                " (SELECT DISTINCT trace_id FROM spans WHERE rollout_id = ?)",
                (rollout_id, rollout_id),
            ).fetchall()
        # In start order: decoded in that order, the records lie in memory roughly in the order
        # the tree walks them, which keeps big rollouts cache-friendly. Sorted here, not by
        # SQLite, whose sorter would move every (kilobyte) body: spans arrive nearly in start
        # order, which Python's sort takes in about one pass.
        rows.sort(key=_START_NS)
        return rows

    def span_count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM spans").fetchone()[0])

    def span_keys(self) -> set[tuple[bytes, bytes]]:
        with self._lock:
            return {(t, s) for t, s in self._db.execute("SELECT trace_id, span_id FROM spans")}

    def iter_rollout_ids(self, state: str | None = None) -> Iterable[str]:
        with self._lock:
            if state is None:
                rows = self._db.execute("SELECT rollout_id FROM rollouts").fetchall()
            else:
                rows = self._db.execute(
                    "SELECT rollout_id FROM rollouts WHERE state = ?", (state,)
                ).fetchall()
        return [r[0] for r in rows]

