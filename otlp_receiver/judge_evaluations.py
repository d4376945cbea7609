"""The reward judge's evaluations of rollouts, kept in the store as ``gen_ai.evaluation.result`` events.

The judge (``trainer_bridge/judge/group_judge.py``, ``reward: judge``) runs in the trainer's own
process, so its scores are trusted as a reward function's are: they are recorded here directly,
not sent through the receiver's OTLP path, where an evaluation event from an agent counts only with
``--evaluation-rewards`` (docs/trust.md). Each row is one event of the OpenTelemetry GenAI
conventions: ``gen_ai.evaluation.result`` with ``gen_ai.evaluation.name`` (``JUDGE_EVALUATION_NAME``),
``gen_ai.evaluation.score.value`` and ``gen_ai.evaluation.explanation``, plus the judge model. The
table ``judge_evaluations`` sits beside ``trained_rollouts`` in the receiver's SQLite store;
``spanrl inspect rollout ID`` shows them (``load``). Stdlib only; a store without the table reads as empty.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from spanrl.instrumentation import semconv

EVENT_NAME = semconv.GENAI_EVALUATION_EVENT  # gen_ai.evaluation.result
JUDGE_EVALUATION_NAME = "spanrl.judge"  # gen_ai.evaluation.name of the judge's events
EXPLANATION_ATTRIBUTE = "gen_ai.evaluation.explanation"
BUSY_TIMEOUT_S = 60.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS judge_evaluations (
    rollout_id   TEXT PRIMARY KEY,
    name         TEXT NOT NULL,   -- gen_ai.evaluation.name
    score        REAL NOT NULL,   -- gen_ai.evaluation.score.value: the judge's score in [0, 1]
    reward       REAL NOT NULL,   -- the reward it made (combined with judge.combine_with, if any)
    explanation  TEXT NOT NULL,   -- gen_ai.evaluation.explanation
    judge_model  TEXT NOT NULL,
    group_size   INTEGER NOT NULL,
    recorded_at  REAL NOT NULL
)
"""


@dataclass(frozen=True)
class JudgeEvaluation:
    """One ``gen_ai.evaluation.result`` event of the judge: a rollout's score and the judge's explanation."""

    rollout_id: str
    score: float
    reward: float
    explanation: str
    judge_model: str
    group_size: int
    name: str = JUDGE_EVALUATION_NAME

    def as_event(self) -> dict:
        """The event as OpenTelemetry names it (``spanrl inspect --json``)."""
        return {"name": EVENT_NAME, "attributes": {
            semconv.GENAI_EVALUATION_NAME: self.name, semconv.GENAI_EVALUATION_SCORE: self.score,
            EXPLANATION_ATTRIBUTE: self.explanation, "gen_ai.request.model": self.judge_model,
            "spanrl.reward": self.reward, "spanrl.judge.group_size": self.group_size}}


def _connect(path: str | Path) -> sqlite3.Connection:
    return sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None)


def record(store_path: str | Path, evaluations: Iterable[JudgeEvaluation]) -> None:
    """Save ``evaluations`` (a rollout judged again replaces its row) in one transaction."""
    rows = [(e.rollout_id, e.name, e.score, e.reward, e.explanation, e.judge_model, e.group_size, time.time())
            for e in evaluations]
    if not rows:
        return
    db = _connect(store_path)
    try:
        db.execute(SCHEMA)
        db.execute("BEGIN IMMEDIATE")
        db.executemany("INSERT OR REPLACE INTO judge_evaluations VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        db.execute("COMMIT")
    finally:
        db.close()


def load(store_path: str | Path) -> dict[str, JudgeEvaluation]:
    """Every recorded evaluation by rollout id (empty when the store has none)."""
    if not Path(store_path).is_file():
        return {}
    db = _connect(store_path)
    try:
        rows = db.execute("SELECT rollout_id, score, reward, explanation, judge_model, group_size, name"
                          " FROM judge_evaluations").fetchall()
    except sqlite3.OperationalError:  # no table: nothing judged yet
        return {}
    finally:
        db.close()
    return {r[0]: JudgeEvaluation(r[0], r[1], r[2], r[3], r[4], r[5], r[6]) for r in rows}
