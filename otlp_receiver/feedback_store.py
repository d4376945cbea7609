"""Feedback that arrives after its rollout: kept in the span store's SQLite file, joined to the
rollout (or the one call) it judges.

Written by the receiver: ``POST /spanrl/v1/feedback`` (``feedback_intake.parse_feedback_body``),
and ``spanrl.reward`` / ``gen_ai.evaluation.result`` span events or log records that come when
their rollout was already assembled, or with no rollout at all (``feedback_intake``). Read by the
trainer (``joined_since``, ``feedback_of`` and ``feedback_join.with_feedback``) and by
``spanrl inspect feedback``::

    book = FeedbackStore("spanrl.db")
    book.submit(Feedback(key="k1", target_kind="response_id", target="chatcmpl-1", value=1.0))
    book.catch_up(span_store)          # index newly assembled rollouts, join what waited for them
    joined, cursor = book.joined_since(0)

A feedback names its target by ``rollout_id``, ``trace_id``, ``span_id`` or ``response_id`` (the
``gen_ai.response.id`` an endpoint returned). When a rollout is assembled its targets are
indexed (``feedback_targets``: its id, its traces, its spans, its calls' response ids, each
with the call it leads to); a feedback joins through that index at once, or, when its target
is not (yet) known, waits ``ttl_s`` (at most ``max_pending`` of them: past that the oldest go)
and joins when the target's rollout is assembled. What expires is deleted and counted. Each
state change is one transaction, and the index has its own cursor in the store, so a kill -9
anywhere loses nothing acknowledged and joins nothing twice.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass

from spanrl.otlp_receiver.feedback_targets import rollout_targets
from spanrl.otlp_receiver.settings import FEEDBACK_MAX_PENDING_DEFAULT, FEEDBACK_TTL_S_DEFAULT
from spanrl.otlp_receiver.span_tree import records_from_bodies
from spanrl.otlp_receiver.store import BUSY_TIMEOUT_MS, SpanStore, StoreError

TARGET_KINDS = ("rollout_id", "trace_id", "span_id", "response_id")
PENDING = "pending"
JOINED = "joined"
DUPLICATE = "duplicate"  # the rollout counted the same event itself (it arrived before assembly)
# What the store counts (``counters()``, ``GET /spanrl/v1/stats``, ``spanrl inspect feedback``)
COUNTERS = ("received", "replayed", "joined", "duplicates", "expired", "evicted", "rejected",
            "clipped", "evaluations_ignored")
INDEX_BATCH = 64  # rollouts indexed per transaction
INDEX_BATCHES_PER_CALL = 4  # an old store is indexed over several assembler polls, not in one

SCHEMA = """
CREATE TABLE IF NOT EXISTS feedback (
    key             TEXT PRIMARY KEY,       -- the client's idempotency key, or the event's identity
    target_kind     TEXT NOT NULL,          -- rollout_id | trace_id | span_id | response_id
    target          TEXT NOT NULL,
    name            TEXT NOT NULL,
    value           REAL NOT NULL,
    comment         TEXT,
    source          TEXT NOT NULL,          -- http | spanrl.reward | gen_ai.evaluation.result
    carrier_span_id TEXT,                   -- the span that carried the event (None: HTTP)
    received_at     REAL NOT NULL,
    state           TEXT NOT NULL,          -- pending | joined | duplicate
    rollout_id      TEXT,
    call_span_id    TEXT,
    joined_at       REAL,
    join_sequence   INTEGER UNIQUE
);
CREATE INDEX IF NOT EXISTS feedback_waiting ON feedback (state, target_kind, target);
CREATE INDEX IF NOT EXISTS feedback_by_rollout ON feedback (rollout_id);
CREATE TABLE IF NOT EXISTS feedback_targets (
    kind         TEXT NOT NULL,
    target       TEXT NOT NULL,
    rollout_id   TEXT NOT NULL,
    call_span_id TEXT,
    PRIMARY KEY (kind, target, rollout_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS feedback_counts (
    name  TEXT PRIMARY KEY,                 -- COUNTERS, plus the index cursor and join sequence
    value INTEGER NOT NULL
);
"""


@dataclass(frozen=True)
class Feedback:
    """One judgement of a rollout or a call, as it arrived (value already checked)."""

    key: str
    target_kind: str
    target: str
    value: float
    name: str = "feedback"
    comment: str | None = None
    source: str = "http"
    carrier_span_id: str | None = None


@dataclass(frozen=True)
class StoredFeedback:
    """A feedback and where it stands: ``pending`` (its target unknown yet), ``joined`` (to
    ``rollout_id`` and, when it judges one call, ``call_span_id``) or ``duplicate``."""

    feedback: Feedback
    state: str
    received_at: float
    rollout_id: str | None
    call_span_id: str | None
    join_sequence: int | None


@dataclass(frozen=True)
class SubmitResult:
    stored: StoredFeedback
    replayed: bool  # the key was known: nothing changed
    conflict: bool  # the key was known with another content: nothing changed


class FeedbackStore:
    """The feedback tables of one store file, on their own connection. Thread-safe."""

    def __init__(self, path, ttl_s: float = FEEDBACK_TTL_S_DEFAULT,
                 max_pending: int = FEEDBACK_MAX_PENDING_DEFAULT) -> None:
        self.path = str(path)
        self.ttl_s = ttl_s
        self.max_pending = max_pending
        self._lock = threading.RLock()
        try:
            SpanStore(self.path).close()  # creates the file owner-only, with the span tables
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                       check_same_thread=False)
            self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self._db.executescript(SCHEMA)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the feedback tables of {self.path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> FeedbackStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _tx(self):
        return _Transaction(self)

    # --- writing ----------------------------------------------------------------------------

    def submit(self, feedback: Feedback, now: float | None = None) -> SubmitResult:
        """Keep ``feedback`` (once per key) and join it when its target is indexed."""
        now = time.time() if now is None else now
        with self._tx() as db:
            known = _select_one(db, "key = ?", (feedback.key,))
            if known is not None:
                conflict = _content(known.feedback) != _content(feedback)
                if not conflict:
                    _bump(db, "replayed")
                return SubmitResult(known, replayed=not conflict, conflict=conflict)
            db.execute(
                "INSERT INTO feedback (key, target_kind, target, name, value, comment, source, carrier_span_id,"
                " received_at, state) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (feedback.key, feedback.target_kind, feedback.target, feedback.name, feedback.value,
                 feedback.comment, feedback.source, feedback.carrier_span_id, now, PENDING))
            _bump(db, "received")
            for rollout_id, call in db.execute(
                    "SELECT rollout_id, call_span_id FROM feedback_targets WHERE kind = ? AND target = ?"
                    " ORDER BY rollout_id LIMIT 1", (feedback.target_kind, feedback.target)):
                _join(db, feedback.key, rollout_id, call, now)
            self._evict(db)
            stored = _select_one(db, "key = ?", (feedback.key,))
        assert stored is not None
        return SubmitResult(stored, replayed=False, conflict=False)

    def count(self, counter: str, n: int = 1) -> None:
        """Count something the intake refused (``rejected``, ``evaluations_ignored``) or clipped."""
        if n:
            with self._tx() as db:
                _bump(db, counter, n)

    def _evict(self, db) -> None:
        waiting = db.execute("SELECT count(*) FROM feedback WHERE state = ?", (PENDING,)).fetchone()[0]
        if waiting > self.max_pending:
            gone = db.execute(
                "DELETE FROM feedback WHERE key IN (SELECT key FROM feedback WHERE state = ?"
                " ORDER BY received_at LIMIT ?)", (PENDING, waiting - self.max_pending)).rowcount
            _bump(db, "evicted", gone)

    def expire(self, now: float | None = None) -> int:
        """Delete feedback that waited longer than ``ttl_s`` for its target; returns how many."""
        now = time.time() if now is None else now
        with self._tx() as db:
            gone = db.execute("DELETE FROM feedback WHERE state = ? AND received_at < ?",
                              (PENDING, now - self.ttl_s)).rowcount
            _bump(db, "expired", gone)
        return gone

    def catch_up(self, spans: SpanStore, now: float | None = None) -> int:
        """Index the targets of rollouts assembled since the last call (the cursor is kept in the
        store; at most ``INDEX_BATCHES_PER_CALL * INDEX_BATCH`` rollouts a call) and join the
        feedback that waited for them; expire what waited too long. Returns how many joined."""
        now = time.time() if now is None else now
        joined = 0
        for _ in range(INDEX_BATCHES_PER_CALL):
            with self._lock:
                cursor = _get(self._db, "indexed_sequence")
            rollouts, next_cursor = spans.completed_rollouts(since=cursor, limit=INDEX_BATCH)
            if not rollouts:
                break
            indexed = [(r, rollout_targets(r, records_from_bodies(s.body for s in spans.rollout_spans(r.rollout_id))))
                       for r in rollouts]
            with self._tx() as db:
                if _get(db, "indexed_sequence") != cursor:
                    continue  # another process indexed them meanwhile
                for rollout, targets in indexed:
                    db.executemany("INSERT OR IGNORE INTO feedback_targets (kind, target, rollout_id, call_span_id)"
                                   " VALUES (?, ?, ?, ?)", [(k, t, rollout.rollout_id, c) for k, t, c in targets])
                    for kind, target, call in targets:
                        waiting = db.execute("SELECT key FROM feedback WHERE state = ? AND target_kind = ?"
                                             " AND target = ?", (PENDING, kind, target)).fetchall()
                        for (key,) in waiting:
                            joined += _join(db, key, rollout.rollout_id, call, now)
                _set(db, "indexed_sequence", next_cursor)
        self.expire(now)
        return joined

    # --- reading ----------------------------------------------------------------------------

    def get(self, key: str) -> StoredFeedback | None:
        with self._lock:
            return _select_one(self._db, "key = ?", (key,))

    def joined_since(self, since: int = 0, limit: int | None = None) -> tuple[list[StoredFeedback], int]:
        """Feedback joined after cursor ``since`` (oldest join first) and the next cursor."""
        query = "join_sequence > ? AND state = ? ORDER BY join_sequence"
        params: tuple = (int(since), JOINED)
        if limit is not None:
            query += " LIMIT ?"
            params += (int(limit),)
        with self._lock:
            rows = _select(self._db, query, params)
        return rows, (rows[-1].join_sequence or since) if rows else int(since)

    def feedback_of(self, rollout_id: str) -> list[StoredFeedback]:
        """The feedback joined to ``rollout_id``, in join order."""
        with self._lock:
            return _select(self._db, "rollout_id = ? AND state = ? ORDER BY join_sequence", (rollout_id, JOINED))

    def all(self, state: str | None = None) -> list[StoredFeedback]:
        """Every feedback kept (or those in ``state``), oldest first."""
        with self._lock:
            if state is None:
                return _select(self._db, "1 ORDER BY received_at", ())
            return _select(self._db, "state = ? ORDER BY received_at", (state,))

    def counters(self) -> dict[str, int]:
        """COUNTERS since the store was made, plus ``pending`` (waiting now)."""
        with self._lock:
            counts = {name: _get(self._db, name) for name in COUNTERS}
            counts["pending"] = self._db.execute("SELECT count(*) FROM feedback WHERE state = ?",
                                                 (PENDING,)).fetchone()[0]
        return counts


class _Transaction:
    def __init__(self, store: FeedbackStore) -> None:
        self.store = store

    def __enter__(self):
        self.store._lock.acquire()
        try:
            self.store._db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            self.store._lock.release()
            raise StoreError(f"cannot write feedback to {self.store.path}: {exc}") from exc
        return self.store._db

    def __exit__(self, exc_type, exc, tb):
        try:
            self.store._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
        finally:
            self.store._lock.release()
        return False


def _content(feedback: Feedback) -> tuple:
    return (feedback.target_kind, feedback.target, feedback.value, feedback.name, feedback.comment)


def _join(db, key: str, rollout_id: str, call_span_id: str | None, now: float) -> int:
    """Join ``key`` to its rollout, or mark it a duplicate of a reward the rollout counted itself."""
    row = db.execute("SELECT source, carrier_span_id, name, value FROM feedback WHERE key = ?", (key,)).fetchone()
    source, carrier, name, value = row
    if carrier is not None and _rollout_counted(db, rollout_id, source, carrier, name, value):
        db.execute("UPDATE feedback SET state = ?, rollout_id = ?, joined_at = ? WHERE key = ?",
                   (DUPLICATE, rollout_id, now, key))
        _bump(db, "duplicates")
        return 0
    sequence = _get(db, "join_sequence") + 1
    _set(db, "join_sequence", sequence)
    db.execute("UPDATE feedback SET state = ?, rollout_id = ?, call_span_id = ?, joined_at = ?, join_sequence = ?"
               " WHERE key = ?", (JOINED, rollout_id, call_span_id, now, sequence, key))
    _bump(db, "joined")
    return 1


def _rollout_counted(db, rollout_id: str, source: str, carrier: str, name: str, value: float) -> bool:
    """Whether the assembled rollout already holds this event's reward (its span came in time)."""
    row = db.execute("SELECT body FROM assembled WHERE rollout_id = ?", (rollout_id,)).fetchone()
    if row is None:
        return False
    return any(r["source"] == source and r["span_id"] == carrier and r["name"] == name and r["value"] == value
               for r in json.loads(row[0])["rewards"])


_COLUMNS = ("key, target_kind, target, value, name, comment, source, carrier_span_id, state, received_at,"
            " rollout_id, call_span_id, join_sequence")


def _select(db, where: str, params: tuple) -> list[StoredFeedback]:
    rows = db.execute(f"SELECT {_COLUMNS} FROM feedback WHERE {where}", params).fetchall()
    return [StoredFeedback(Feedback(*r[:8]), state=r[8], received_at=r[9], rollout_id=r[10], call_span_id=r[11],
                           join_sequence=r[12]) for r in rows]


def _select_one(db, where: str, params: tuple) -> StoredFeedback | None:
    rows = _select(db, where, params)
    return rows[0] if rows else None


def _get(db, name: str) -> int:
    row = db.execute("SELECT value FROM feedback_counts WHERE name = ?", (name,)).fetchone()
    return 0 if row is None else int(row[0])


def _set(db, name: str, value: int) -> None:
    db.execute("INSERT INTO feedback_counts (name, value) VALUES (?, ?)"
               " ON CONFLICT (name) DO UPDATE SET value = excluded.value", (name, int(value)))


def _bump(db, name: str, n: int = 1) -> None:
    if n:
        db.execute("INSERT INTO feedback_counts (name, value) VALUES (?, ?)"
                   " ON CONFLICT (name) DO UPDATE SET value = value + excluded.value", (name, int(n)))
