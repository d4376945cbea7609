"""Read-only access to a span store for the dashboard: open it, and page through its rollouts.

Called by the dashboard's pages (``pages.py``) and by ``run_queries.py``. The store is the
receiver's SQLite file (schema: ``otlp_receiver/store.py`` and ``trained_rewards.py``), opened
with ``mode=ro`` so the dashboard can never change it, while a receiver and a trainer write it
(WAL). Nothing here loads a whole table: the rollouts list is one page of row ids found with
cheap columns first (``LIMIT``/``OFFSET``), then the details of those rows only. A file that is
missing, not SQLite, or not a spanrl store raises ``StoreProblem`` with a message for the page.
"""

from __future__ import annotations

import os
import sqlite3
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spanrl.bridge_protocol import TRAINING_ROLLOUT_PREFIX, VALIDATION_ROLLOUT_PREFIX

if TYPE_CHECKING:
    from .facet_index import FacetIndex

REQUIRED_TABLES = ("rollouts", "assembled", "spans")
TRAINED_TABLE = "trained_rollouts"
BUSY_TIMEOUT_S = 10.0
STATUSES = ("ok", "failed", "open", "broken")  # assembled ok/failed, or the receiver's state
KINDS = ("training", "validation")
SORTS = {
    "newest": "r.rowid DESC",
    "oldest": "r.rowid ASC",
    "reward_desc": "sort_reward IS NULL, sort_reward DESC, r.rowid DESC",
    "reward_asc": "sort_reward IS NULL, sort_reward ASC, r.rowid DESC",
    "task": "r.task_id IS NULL, r.task_id, r.rowid",
}


class StoreProblem(Exception):
    """The store cannot be read as a spanrl store; the message says why and what to do."""


@dataclass
class StoreReader:
    """One read-only connection to a store (one per request); ``trained``: the trainer has
    written its ``trained_rollouts`` table; ``advantages``: and it records advantages;
    ``indexed``: the dashboard's facet index (``facet_index.py``) is attached as ``ix`` and
    covers the assembled rollouts up to this sequence (0: none attached)."""

    path: str
    db: sqlite3.Connection
    trained: bool
    advantages: bool
    indexed: int = 0

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_store(path: str, index: FacetIndex | None = None) -> StoreReader:
    """Open ``path`` read-only (with ``index`` attached); ``StoreProblem`` when it is missing, not
    SQLite or not spanrl's."""
    if not os.path.exists(path):
        raise StoreProblem(f"no span store at {path}: start `spanrl receive --db {path}` (training writes "
                           "it), or point the dashboard at the receiver's store with --store")
    if os.path.isdir(path):
        raise StoreProblem(f"{path} is a folder, not a span store: give the receiver's --db file")
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"
    try:
        db = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        tables = {name for name, in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as exc:
        raise StoreProblem(f"{path} is not a spanrl span store: SQLite cannot read it ({exc})") from exc
    missing = [t for t in REQUIRED_TABLES if t not in tables]
    if missing:
        db.close()
        raise StoreProblem(f"{path} is an SQLite file but not a spanrl span store (it has no table "
                           f"{', '.join(missing)}); give the file `spanrl receive --db` writes")
    advantages = False
    if TRAINED_TABLE in tables:
        columns = {row[1] for row in db.execute(f"PRAGMA table_info({TRAINED_TABLE})")}
        advantages = "advantages" in columns
    return StoreReader(path, db, TRAINED_TABLE in tables, advantages, attach(db, index))


def step_of_rollout(rollout_id: str) -> tuple[str, int] | None:
    """``("training", k)`` for a rollout the bridge handed out for step ``k`` (1-based, the
    metrics row it feeds), ``("validation", k)`` for the validation round after step ``k``;
    ``None`` for ids the bridge did not make."""
    prefix, rest = rollout_id[:1], rollout_id[1:]
    number = rest.split("-", 1)[0]
    if not number.isdigit() or "-" not in rest:
        return None
    if prefix == TRAINING_ROLLOUT_PREFIX:
        return "training", int(number) + 1
    if prefix == VALIDATION_ROLLOUT_PREFIX:
        return "validation", int(number)
    return None


def step_globs(step: int, kind: str | None = None) -> list[str]:
    """GLOB patterns of the rollout ids of step ``step`` (both kinds unless ``kind`` says)."""
    patterns = []
    if kind in (None, "training") and step >= 1:
        patterns.append(f"{TRAINING_ROLLOUT_PREFIX}{step - 1}-*")
    if kind in (None, "validation"):
        patterns.append(f"{VALIDATION_ROLLOUT_PREFIX}{step}-*")
    return patterns


@dataclass(frozen=True)
class RolloutFilter:
    """What the rollouts page filters on; ``None`` = any."""

    step: int | None = None
    task: str | None = None
    status: str | None = None
    agent: str | None = None
    kind: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    sort: str = "newest"


@dataclass(frozen=True)
class RolloutRow:
    """One line of the rollouts page."""

    rollout_id: str
    task_id: str | None
    attempt: int | None
    state: str
    span_count: int
    first_seen: float
    status: str | None           # ok | failed once assembled
    error: str | None
    transitions: int | None
    agents: tuple[str, ...]
    event_reward: float | None   # sum of its reward events
    trained_step: int | None     # the step that scored it
    trained_reward: float | None
    used: bool | None            # trained on (True), scored but left out of the update (False)

    @property
    def reward(self) -> float | None:
        return self.trained_reward if self.trained_reward is not None else self.event_reward

    @property
    def step(self) -> tuple[str, int] | None:
        return step_of_rollout(self.rollout_id)


@dataclass(frozen=True)
class RolloutPage:
    rows: tuple[RolloutRow, ...]
    page: int
    has_next: bool


def reward_sql(reader: StoreReader) -> str:
    """The reward shown for a rollout ``r``: what GRPO trained it with, else the sum of its reward
    events. With the facet index attached (joined as ``f``) it is the index's for the rollouts it
    covers; others are read from the store."""
    trained = f"(SELECT reward FROM {TRAINED_TABLE} WHERE rollout_id = r.rollout_id), " if reader.trained else ""
    from_store = (f"coalesce({trained}(SELECT json_extract(body, '$.total_reward') FROM assembled"
                  " WHERE rollout_id = r.rollout_id))")
    if not reader.indexed:
        return from_store
    return f"(CASE WHEN f.rollout_id IS NOT NULL THEN f.reward ELSE {from_store} END)"


FACETS_JOIN = " LEFT JOIN ix.facets f ON f.rollout_id = r.rollout_id"


def _body_condition(reader: StoreReader, indexed: str, in_body: str, value) -> tuple[str, list]:
    """A condition on something inside the body of rollout ``r``: through the facet index where it
    covers the rollout (``indexed``: a condition on ``ix`` tables, correlated on ``r``), read
    from the body after it (``in_body``, on ``body``). Per rollout, so a page stops early."""
    if reader.indexed:
        return (f"(EXISTS ({indexed}) OR EXISTS (SELECT 1 FROM assembled WHERE rollout_id = r.rollout_id"
                f" AND sequence > ? AND {in_body}))", [value, reader.indexed, value])
    return (f"EXISTS (SELECT 1 FROM assembled WHERE rollout_id = r.rollout_id AND {in_body})", [value])


def _where(reader: StoreReader, f: RolloutFilter) -> tuple[list[str], list]:
    """SQL conditions on ``rollouts r`` and their parameters."""
    conditions: list[str] = []
    params: list = []
    if f.step is not None:
        globs = step_globs(f.step, f.kind)
        conditions.append("(" + " OR ".join("r.rollout_id GLOB ?" for _ in globs) + ")" if globs else "0")
        params.extend(globs)
    elif f.kind is not None:
        prefix = TRAINING_ROLLOUT_PREFIX if f.kind == "training" else VALIDATION_ROLLOUT_PREFIX
        conditions.append("r.rollout_id GLOB ?")
        params.append(f"{prefix}[0-9]*-*")
    if f.task is not None:
        conditions.append("r.task_id = ?")
        params.append(f.task)
    found: list[tuple[str, list]] = []
    if f.status in ("open", "broken"):
        found.append(("r.state = ?", [f.status]))
    elif f.status in ("ok", "failed"):
        found.append(_body_condition(reader, "SELECT 1 FROM ix.facets WHERE rollout_id = r.rollout_id AND status = ?",
                                     "json_extract(body, '$.status') = ?", f.status))
    if f.agent is not None:
        found.append(_body_condition(
            reader, "SELECT 1 FROM ix.facet_agents WHERE agent = ? AND rollout_id = r.rollout_id",
            "EXISTS (SELECT 1 FROM json_each(body, '$.transitions') j WHERE json_extract(j.value, '$.agent_name') = ?)",
            f.agent))
    for bound, op in ((f.reward_min, ">="), (f.reward_max, "<=")):
        if bound is not None:
            found.append((f"{reward_sql(reader)} {op} ?", [bound]))
    for condition, values in found:
        conditions.append(condition)
        params.extend(values)
    return conditions, params


def rollout_page(reader: StoreReader, f: RolloutFilter, page: int, page_size: int) -> RolloutPage:
    """Page ``page`` (from 1) of the rollouts ``f`` selects, in ``f.sort`` order."""
    if f.sort not in SORTS:
        raise ValueError(f"sort must be one of {sorted(SORTS)}, got {f.sort!r}")
    conditions, params = _where(reader, f)
    by_reward = f.sort.startswith("reward")
    reward = reward_sql(reader) if by_reward else "NULL"
    uses_reward = by_reward or f.reward_min is not None or f.reward_max is not None
    joins = FACETS_JOIN if reader.indexed and uses_reward else ""
    where = (" WHERE " + " AND ".join(conditions)) if conditions else ""
    query = (f"SELECT r.rowid, {reward} AS sort_reward FROM rollouts r{joins}{where}"
             f" ORDER BY {SORTS[f.sort]} LIMIT ? OFFSET ?")
    ids = [row[0] for row in reader.db.execute(query, [*params, page_size + 1, (page - 1) * page_size])]
    rows = rollout_rows(reader, ids[:page_size])
    return RolloutPage(tuple(rows), page, len(ids) > page_size)


def rollout_rows(reader: StoreReader, rowids: list[int]) -> list[RolloutRow]:
    """The page's lines for these ``rollouts`` row ids, in the order given."""
    if not rowids:
        return []
    trained = (f", t.step, t.reward, t.used FROM rollouts r LEFT JOIN {TRAINED_TABLE} t"
               " ON t.rollout_id = r.rollout_id" if reader.trained else ", NULL, NULL, NULL FROM rollouts r")
    query = (
        "SELECT r.rowid, r.rollout_id, r.task_id, r.attempt, r.state, r.span_count, r.first_seen,"
        " json_extract(a.body, '$.status'), json_extract(a.body, '$.error'),"
        " json_array_length(a.body, '$.transitions'), json_extract(a.body, '$.total_reward'),"
        " (SELECT group_concat(name, char(31)) FROM (SELECT DISTINCT json_extract(j.value, '$.agent_name')"
        "  AS name FROM json_each(a.body, '$.transitions') j WHERE name IS NOT NULL ORDER BY name))"
        f"{trained} LEFT JOIN assembled a ON a.rollout_id = r.rollout_id"
        f" WHERE r.rowid IN ({','.join('?' * len(rowids))})"
    )
    found = {}
    for row in reader.db.execute(query, rowids):
        found[row[0]] = RolloutRow(
            rollout_id=row[1], task_id=row[2], attempt=row[3], state=row[4], span_count=row[5],
            first_seen=row[6], status=row[7], error=row[8], transitions=row[9], event_reward=row[10],
            agents=tuple(row[11].split("\x1f")) if row[11] else (), trained_step=row[12],
            trained_reward=row[13], used=None if row[14] is None else bool(row[14]),
        )
    return [found[i] for i in rowids if i in found]


def rollouts_with_globs(reader: StoreReader, globs: list[str], task: str | None = None) -> list[RolloutRow]:
    """Every rollout whose id matches one of ``globs`` (one step's round: bounded), oldest first."""
    if not globs:
        return []
    query = "SELECT rowid FROM rollouts WHERE (" + " OR ".join("rollout_id GLOB ?" for _ in globs) + ")"
    params: list = list(globs)
    if task is not None:
        query += " AND task_id = ?"
        params.append(task)
    return rollout_rows(reader, [row[0] for row in reader.db.execute(query + " ORDER BY rowid", params)])


def attach(db: sqlite3.Connection, index: FacetIndex | None) -> int:
    """Attach ``index`` read-only to a store connection as ``ix``; returns the last sequence it
    covers (0: nothing attached, every rollout is read from its body)."""
    if index is None:
        return 0
    covered = index.indexed_sequence  # read before attaching: what the file holds is at least this
    uri = "file:" + urllib.parse.quote(index.path) + "?mode=ro"
    db.execute("ATTACH DATABASE ? AS ix", (uri,))
    return covered
