"""The span store's tables: the SQLite DDL ``SpanStore`` runs when it opens a file.

``CREATE ... IF NOT EXISTS`` throughout, so opening an existing store leaves it as it is. The
columns are read and written by ``store.py`` and ``span_writes.py``; docs/interfaces.md section 2
describes the stored rollouts for readers outside the receiver.
"""

SCHEMA = """
-- A rowid table (not WITHOUT ROWID): span bodies are kilobytes, too big for index pages.
-- The unique key leads with the rollout id: a commit's new keys then cluster in a few index
-- pages instead of one random page per span (trace and span ids are random), which costs
-- about a third of the write time; it also serves "the spans of rollout X". A retried span
-- carries the same attributes, hence the same rollout id, so retries stay idempotent.
CREATE TABLE IF NOT EXISTS spans (
    rollout_id  TEXT NOT NULL,              -- '' for a span without rollout identity
    trace_id    BLOB NOT NULL,
    span_id     BLOB NOT NULL,
    name        TEXT NOT NULL,
    start_ns    INTEGER NOT NULL,
    received_at REAL NOT NULL,
    body        BLOB NOT NULL,              -- serialized opentelemetry.proto.trace.v1.Span
    UNIQUE (rollout_id, trace_id, span_id)
);
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id              TEXT PRIMARY KEY,
    task_id                 TEXT,
    attempt                 INTEGER,
    first_seen              REAL NOT NULL,
    last_seen               REAL NOT NULL,
    span_count              INTEGER NOT NULL DEFAULT 0,
    root_seen_at            REAL,           -- the spanrl.rollout span arrived (it has ended)
    completion_requested_at REAL,           -- explicit completion
    state                   TEXT NOT NULL DEFAULT 'open',   -- open | assembled | broken
    broken_reason           TEXT,                           -- why assembly failed
    late_spans              INTEGER NOT NULL DEFAULT 0      -- spans refused: they came after assembly
);
-- Completions asked for before any span of the rollout arrived (see complete_rollout).
CREATE TABLE IF NOT EXISTS pending_completions (
    rollout_id   TEXT PRIMARY KEY,
    requested_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS pending_completions_by_time ON pending_completions (requested_at);
CREATE INDEX IF NOT EXISTS rollouts_by_state ON rollouts (state);
CREATE TABLE IF NOT EXISTS assembled (
    sequence     INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout_id   TEXT NOT NULL UNIQUE,
    assembled_at REAL NOT NULL,
    body         TEXT NOT NULL              -- JSON of schema.rollouts.AssembledRollout
);
"""
