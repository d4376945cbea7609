"""The Text-to-SQL agent's database: a small company (employees, projects) in SQLite.

The rows are fixed data written out below (generated once by a seeded generator and committed, so
every run, test and machine sees the same database). ``connect()`` builds it in memory, read-only,
in well under a millisecond: each query of the agent, the question generator and the reward runs
on a fresh copy, so a query can neither change the data nor see another's. ``SCHEMA_TEXT`` is the
one-line description the agent's prompts show the model.

The queries come from a model in training, so they are treated as hostile: an authorizer
(``_authorize``) denies ``ATTACH`` (which would create a file; ``VACUUM`` attaches its target
too, so ``VACUUM INTO`` is denied with it) and every ``PRAGMA`` but a few that only read the
schema (so ``PRAGMA query_only = OFF`` cannot undo the read-only mode); a progress handler
stops a query that runs longer than ``QUERY_TIMEOUT_S`` (a recursive CTE can loop forever), and
no value may grow beyond ``MAX_VALUE_BYTES``.
"""

from __future__ import annotations

import sqlite3
import time

DEPARTMENTS = ("Sales", "Research", "Support", "Finance", "Legal")
CITIES = ("Paris", "Berlin", "Oslo", "Rome", "Madrid")

# (name, dept, city, salary, age)
EMPLOYEES = (
    ("Ada", "Research", "Berlin", 7200, 36), ("Ben", "Sales", "Paris", 4100, 29),
    ("Cleo", "Support", "Oslo", 3500, 24), ("Dan", "Finance", "Rome", 5600, 45),
    ("Eva", "Legal", "Madrid", 6900, 51), ("Finn", "Sales", "Berlin", 4500, 33),
    ("Gus", "Research", "Paris", 8100, 42), ("Hana", "Support", "Rome", 3300, 27),
    ("Ivo", "Finance", "Oslo", 6100, 39), ("Jade", "Legal", "Paris", 7500, 48),
    ("Kai", "Sales", "Madrid", 3900, 25), ("Lea", "Research", "Oslo", 6600, 31),
    ("Milo", "Support", "Berlin", 3700, 35), ("Nora", "Finance", "Madrid", 5200, 28),
    ("Otto", "Legal", "Berlin", 8000, 56), ("Pia", "Sales", "Rome", 4800, 41),
    ("Quin", "Research", "Madrid", 7000, 30), ("Rosa", "Support", "Paris", 3100, 22),
    ("Sam", "Finance", "Berlin", 5900, 44), ("Tara", "Legal", "Oslo", 7100, 38),
    ("Uma", "Sales", "Oslo", 4300, 34), ("Vic", "Research", "Rome", 7700, 47),
    ("Wes", "Support", "Madrid", 3400, 26), ("Xia", "Finance", "Paris", 6300, 52),
    ("Yan", "Legal", "Rome", 6500, 32), ("Zoe", "Sales", "Paris", 5000, 37),
    ("Abe", "Research", "Berlin", 6800, 29), ("Bea", "Support", "Oslo", 3600, 43),
    ("Cal", "Finance", "Rome", 5400, 23), ("Dia", "Legal", "Madrid", 7300, 40),
)

# (name, dept, budget)
PROJECTS = (
    ("Apollo", "Research", 900), ("Beacon", "Sales", 300), ("Comet", "Support", 150),
    ("Delta", "Finance", 400), ("Echo", "Legal", 250), ("Falcon", "Research", 700),
    ("Gemini", "Sales", 350), ("Helix", "Research", 550), ("Iris", "Support", 200),
    ("Juno", "Finance", 600), ("Kepler", "Legal", 450), ("Luna", "Sales", 500),
)

SCHEMA = (
    "CREATE TABLE employees (name TEXT PRIMARY KEY, dept TEXT, city TEXT, salary INTEGER, age INTEGER);"
    "CREATE TABLE projects (name TEXT PRIMARY KEY, dept TEXT, budget INTEGER);"
)
SCHEMA_TEXT = "employees(name, dept, city, salary, age); projects(name, dept, budget)"


# Pragmas a query may use: each only reads the schema (with a table or index name as argument).
READ_ONLY_PRAGMAS = frozenset({"table_info", "table_xinfo", "table_list", "index_list", "index_info",
                               "index_xinfo", "foreign_key_list"})
QUERY_TIMEOUT_S = 2.0  # the agent's queries take microseconds on this database
MAX_VALUE_BYTES = 1_000_000  # a string or blob a query makes (SQLite's default: 1 GB, e.g. x || x in a loop)
PROGRESS_EVERY = 10_000  # SQLite virtual machine instructions between two looks at the clock


def _authorize(action: int, argument1: str | None, argument2: str | None, database: str | None,
               trigger: str | None) -> int:
    """SQLite's authorizer: deny ATTACH (VACUUM INTO runs one too) and pragmas outside ``READ_ONLY_PRAGMAS``."""
    if action == sqlite3.SQLITE_ATTACH:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_PRAGMA and (argument1 or "").lower() not in READ_ONLY_PRAGMAS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def connect() -> sqlite3.Connection:
    """A fresh in-memory copy of the database, read-only (``PRAGMA query_only``), with the
    authorizer on (set after the copy is built: building it needs writes)."""
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.executescript(SCHEMA)
    db.executemany("INSERT INTO employees VALUES (?, ?, ?, ?, ?)", EMPLOYEES)
    db.executemany("INSERT INTO projects VALUES (?, ?, ?)", PROJECTS)
    db.commit()
    db.execute("PRAGMA query_only = ON")
    db.set_authorizer(_authorize)
    db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    return db


MAX_ROWS = 50  # a query returning more is cut: a model's runaway query must not flood the prompt


class QueryTimeout(sqlite3.OperationalError):
    """The query ran longer than its deadline and was stopped."""


def run_query(query: str, timeout_s: float = QUERY_TIMEOUT_S) -> list[tuple]:
    """The rows of ``query`` on a fresh copy of the database (at most ``MAX_ROWS``).

    Raises ``sqlite3.Error`` for a query SQLite rejects (``not authorized`` for a denied statement;
    ``QueryTimeout`` past ``timeout_s``), and ``sqlite3.Warning`` for more than one statement, as
    SQLite words it."""
    db = connect()
    deadline = time.monotonic() + timeout_s
    db.set_progress_handler(lambda: int(time.monotonic() > deadline), PROGRESS_EVERY)
    try:
        return db.execute(query).fetchmany(MAX_ROWS)
    except sqlite3.OperationalError as exc:
        if time.monotonic() > deadline and "interrupted" in str(exc):
            raise QueryTimeout(f"query stopped: it ran longer than {timeout_s:g} s") from exc
        raise
    finally:
        db.close()


def format_rows(rows: list[tuple]) -> str:
    """Rows as the agent shows them to the model: one row a line, values joined by ', '."""
    if not rows:
        return "no rows"
    return "\n".join(", ".join(_format_value(v) for v in row) for row in rows)


def _format_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}".rstrip("0").rstrip(".")
    return str(value)
