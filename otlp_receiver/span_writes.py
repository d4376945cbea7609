"""The steps of the store's write transaction, on an open SQLite connection inside it.

Called by ``SpanStore.write_spans`` (``store.py``) only: insert one rollout's spans (a row SQLite
cannot hold is rejected alone), refuse spans of a rollout already assembled, and keep each
rollout's bookkeeping row (span count, last activity, root seen, a completion asked for early).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

from spanrl.otlp_receiver.otlp_decode import SpanRow

INSERT_SPAN = (
    "INSERT OR IGNORE INTO spans (trace_id, span_id, rollout_id, name, start_ns, received_at, body)"
    " VALUES (?, ?, ?, ?, ?, ?, ?)"
)
# Errors binding one row's values (an integer beyond SQLite's signed 64 bits, a wrong type):
# that row is rejected; any other sqlite3.Error is the store's and fails the whole write.
UNSTORABLE_ERRORS = (OverflowError, ValueError, TypeError, sqlite3.InterfaceError, sqlite3.DataError)
ROLLOUT_ALREADY_ASSEMBLED = (
    "rollout {rollout_id!r} was already assembled; spans arriving after its assembly are not"
    " stored (a rerun needs its own spanrl.rollout.id)"
)


@dataclass(frozen=True)
class RejectedSpan:
    """A row ``write_spans`` did not store: its position in the rows given, and why."""

    index: int
    reason: str


def refuse_late(db, rollout_id: str, group: list[tuple[int, SpanRow]], rejected: list[RejectedSpan]) -> None:
    """Spans of an assembled rollout: a retry of a span already stored is acknowledged
    again (idempotent); a new span is refused and counted in ``late_spans``."""
    reason = ROLLOUT_ALREADY_ASSEMBLED.format(rollout_id=rollout_id)
    late = 0
    for index, row in group:
        stored = db.execute("SELECT 1 FROM spans WHERE rollout_id = ? AND trace_id = ? AND span_id = ?",
                            (rollout_id, row.trace_id, row.span_id)).fetchone()
        if stored is None:
            rejected.append(RejectedSpan(index, reason))
            late += 1
    if late:
        db.execute("UPDATE rollouts SET late_spans = late_spans + ? WHERE rollout_id = ?", (late, rollout_id))


def assembled_among(db, rollout_ids: list[str]) -> set[str]:
    """Which of ``rollout_ids`` are assembled already."""
    return {r for r, in _select_in(
        db, "SELECT rollout_id FROM rollouts WHERE state = 'assembled' AND rollout_id IN", rollout_ids)}


def pending_completions_among(db, rollout_ids: list[str]) -> dict[str, float]:
    """Completions asked for before any span of these rollouts arrived: id -> when asked."""
    return dict(_select_in(
        db, "SELECT rollout_id, requested_at FROM pending_completions WHERE rollout_id IN", rollout_ids))


def insert_group(db, rollout_id: str, group: list[tuple[int, SpanRow]], now: float,
                 rejected: list[RejectedSpan]) -> tuple[list[SpanRow], int]:
    """Insert one rollout's rows; returns the rows stored and how many were new. A row SQLite
    cannot hold is rejected alone: the group is rolled back to its savepoint and retried
    row by row, so the other rows of the request are still stored."""
    params = [(r.trace_id, r.span_id, rollout_id, r.name, r.start_ns, now, r.body) for _, r in group]
    db.execute("SAVEPOINT span_group")
    changes_before = db.total_changes
    try:
        db.executemany(INSERT_SPAN, params)
        stored = [row for _, row in group]
    except UNSTORABLE_ERRORS:
        db.execute("ROLLBACK TO span_group")
        changes_before = db.total_changes
        stored = []
        for (index, row), values in zip(group, params, strict=True):
            try:
                db.execute(INSERT_SPAN, values)
            except UNSTORABLE_ERRORS as exc:
                rejected.append(RejectedSpan(index, f"the store cannot hold this span: {exc}"))
            else:
                stored.append(row)
    inserted = db.total_changes - changes_before
    db.execute("RELEASE span_group")
    return stored, inserted


def count_new_spans(db, rollout_id: str, group: Sequence[SpanRow], inserted: int, now: float,
                    completion_requested_at: float | None) -> None:
    """Record ``inserted`` new spans of ``rollout_id`` (rows of ``group``) in ``rollouts``;
    ``completion_requested_at``: a completion asked for before any of its spans arrived."""
    task_id = next((r.task_id for r in group if r.task_id is not None), None)
    attempt = next((r.attempt for r in group if r.attempt is not None), None)
    # A root span that was a duplicate already set root_seen_at when first stored.
    root_seen_at = now if any(r.is_rollout_root for r in group) else None
    db.execute(
        "INSERT INTO rollouts (rollout_id, task_id, attempt, first_seen, last_seen,"
        " span_count, root_seen_at, completion_requested_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (rollout_id) DO UPDATE SET"
        " task_id = coalesce(rollouts.task_id, excluded.task_id),"
        " attempt = coalesce(rollouts.attempt, excluded.attempt),"
        " last_seen = excluded.last_seen,"
        " span_count = rollouts.span_count + excluded.span_count,"
        " root_seen_at = coalesce(rollouts.root_seen_at, excluded.root_seen_at),"
        " completion_requested_at = coalesce(rollouts.completion_requested_at,"
        "   excluded.completion_requested_at)",
        (rollout_id, task_id, attempt, now, now, inserted, root_seen_at, completion_requested_at),
    )


def _select_in(db, query: str, values: list[str]) -> list[tuple]:
    """``query`` ending in ``IN`` run over ``values`` in chunks (SQLite bounds bound parameters)."""
    found: list[tuple] = []
    for start in range(0, len(values), 500):
        chunk = values[start:start + 500]
        found.extend(db.execute(f"{query} ({','.join('?' * len(chunk))})", chunk).fetchall())
    return found
