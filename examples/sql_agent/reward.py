"""Reward of the Text-to-SQL agent: execution match with the gold answer (1.0 or 0.0).

The agent's final query is run on the database; it scores 1.0 when its rows equal the task's gold
rows as a multiset (row order is ignored: ``ORDER BY`` in a question's gold SQL only picks the
row, as in ``... ORDER BY age DESC LIMIT 1``), floats compared to 2 decimals. A query SQLite
rejects, or no query at all, scores 0.0.

``execution_match`` is what ``rollout.solve`` emits as the rollout's ``spanrl.reward`` event (so the
receiver's AIR rewards and this reward meet in one rollout); ``reward`` is the same as a trainer-side
reward function (``reward: spanrl.examples.sql_agent.reward:reward``) for runs without AIR.
"""

from __future__ import annotations

import sqlite3
from collections import Counter

from .database import run_query
from .questions import answer_rows


def _multiset(rows: list) -> Counter:
    return Counter(tuple(row) for row in rows)


def execution_match(query: str, gold_answer: list) -> float:
    """1.0 when ``query`` runs and returns the gold rows (in any order), else 0.0."""
    if not query or not query.strip():
        return 0.0
    try:
        rows = answer_rows(run_query(query))
    except (sqlite3.Error, sqlite3.Warning, ValueError):  # ValueError: e.g. a NUL character
        return 0.0
    return 1.0 if _multiset(rows) == _multiset(gold_answer) else 0.0


def reward(task: dict, variables: dict) -> float:
    """The trainer-side form: the runner records the agent's final query as the variable ``output``."""
    return execution_match(str(variables.get("output", "")), task["answer"])
