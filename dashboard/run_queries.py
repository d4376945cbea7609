"""The dashboard's questions about a run, asked of its store: per-step reward spread, the agents
of a step, validation rounds, one rollout with its spans, a task's rollouts at one step.

Called by ``pages.py`` with a ``store_reader.StoreReader``. Aggregates over every step run in
SQL over the small ``trained_rollouts`` rows (never the rollout bodies); questions about one
step or one rollout read only that step's or that rollout's bodies.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field

from spanrl.schema.rollouts import AssembledRollout, rollout_from_dict

from .store_reader import (
    TRAINED_TABLE,
    RolloutRow,
    StoreReader,
    rollout_rows,
    rollouts_with_globs,
    step_globs,
    step_of_rollout,
)


@dataclass(frozen=True)
class StepRewards:
    """The rewards the trainer scored one step's rollouts with: their spread."""

    step: int
    rollouts: int
    used: int
    mean: float
    std: float
    low: float
    high: float


def step_rewards(reader: StoreReader) -> list[StepRewards]:
    """Per training step: how many rollouts were scored, mean, population std, min, max."""
    if not reader.trained:
        return []
    rows = reader.db.execute(
        f"SELECT step, count(*), sum(used), avg(reward), avg(reward * reward), min(reward), max(reward)"
        f" FROM {TRAINED_TABLE} GROUP BY step ORDER BY step").fetchall()
    return [StepRewards(step, n, int(used or 0), mean, math.sqrt(max(square - mean * mean, 0.0)), low, high)
            for step, n, used, mean, square, low, high in rows]


@dataclass(frozen=True)
class TrainedRecord:
    """What ``spanrl train`` recorded for one rollout (``trained_rewards`` in the store)."""

    step: int
    reward: float
    reward_source: str
    used: bool
    returns: dict[int, float]
    advantages: dict[int, float] | None  # None: a store whose trainer did not record them


def trained_record(reader: StoreReader, rollout_id: str) -> TrainedRecord | None:
    if not reader.trained:
        return None
    advantages = "advantages" if reader.advantages else "NULL"
    row = reader.db.execute(
        f"SELECT step, reward, reward_source, used, returns, {advantages} FROM {TRAINED_TABLE}"
        " WHERE rollout_id = ?", (rollout_id,)).fetchone()
    if row is None:
        return None
    step, reward, source, used, returns, advantage_json = row
    return TrainedRecord(
        step, reward, source, bool(used), {int(k): float(v) for k, v in json.loads(returns).items()},
        None if advantage_json is None else {int(k): float(v) for k, v in json.loads(advantage_json).items()},
    )


@dataclass(frozen=True)
class StoredRollout:
    """One rollout: its line, its assembled body (None while open), its spans' bodies."""

    row: RolloutRow
    rollout: AssembledRollout | None
    span_bodies: tuple[bytes, ...]
    trained: TrainedRecord | None
    broken_reason: str | None = None


def stored_rollout(reader: StoreReader, rollout_id: str) -> StoredRollout | None:
    """Everything the rollout page shows of ``rollout_id``; None when the store has no such id."""
    found = reader.db.execute("SELECT rowid, broken_reason FROM rollouts WHERE rollout_id = ?",
                              (rollout_id,)).fetchone()
    if found is None:
        return None
    row = rollout_rows(reader, [found[0]])[0]
    body = reader.db.execute("SELECT body FROM assembled WHERE rollout_id = ?", (rollout_id,)).fetchone()
    # the spans carrying its id, plus spans without one in its traces (as SpanStore.rollout_spans)
    spans = reader.db.execute(
        "SELECT body FROM (SELECT start_ns, body FROM spans WHERE rollout_id = ?"
        " UNION ALL SELECT s.start_ns, s.body FROM spans s WHERE s.rollout_id = '' AND s.trace_id IN"
        " (SELECT DISTINCT trace_id FROM spans WHERE rollout_id = ?)) ORDER BY start_ns",
        (rollout_id, rollout_id)).fetchall()
    rollout = rollout_from_dict(json.loads(body[0])) if body and body[0] else None
    return StoredRollout(row, rollout, tuple(bytes(s[0]) for s in spans), trained_record(reader, rollout_id),
                         found[1])


def rollouts_of_step(reader: StoreReader, step: int, kind: str | None = None,
                     task: str | None = None) -> list[StoredRollout]:
    """The rollouts of one step's round (and of one task), with their bodies, without spans."""
    rows = rollouts_with_globs(reader, step_globs(step, kind), task)
    if not rows:
        return []
    ids = [r.rollout_id for r in rows]
    bodies = dict(reader.db.execute(
        f"SELECT rollout_id, body FROM assembled WHERE rollout_id IN ({','.join('?' * len(ids))})", ids))
    return [StoredRollout(r, rollout_from_dict(json.loads(bodies[r.rollout_id])) if bodies.get(r.rollout_id)
                          else None, (), trained_record(reader, r.rollout_id)) for r in rows]


@dataclass
class AgentBreakdown:
    """One agent's calls in one step: selective training trains only the named agents' calls."""

    agent: str
    calls: int = 0
    trained_calls: int = 0
    rollouts: set = field(default_factory=set)
    rewards: list = field(default_factory=list)

    @property
    def mean_reward(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None


NO_AGENT = "(no agent name)"


def agent_breakdown(reader: StoreReader, step: int) -> list[AgentBreakdown]:
    """Per agent name, the calls of step ``step``'s training rollouts and how many were trained."""
    by_agent: dict[str, AgentBreakdown] = {}
    for item in rollouts_of_step(reader, step, "training"):
        if item.rollout is None:
            continue
        trained = item.trained
        for transition in item.rollout.transitions:
            name = transition.agent_name or NO_AGENT
            entry = by_agent.setdefault(name, AgentBreakdown(name))
            entry.calls += 1
            if trained is not None and trained.used and transition.index in trained.returns:
                entry.trained_calls += 1
            if item.rollout.rollout_id not in entry.rollouts:
                entry.rollouts.add(item.rollout.rollout_id)
                if item.row.reward is not None:
                    entry.rewards.append(item.row.reward)
    return sorted(by_agent.values(), key=lambda a: a.agent)


@dataclass(frozen=True)
class ValidationRound:
    """The validation rollouts the store holds for the round after one step."""

    step: int
    rollouts: int
    assembled: int
    ok: int
    event_reward_mean: float | None  # mean of their reward events' sums (a reward function's
                                     # scores are in metrics.jsonl's val_reward only)


def validation_rounds(reader: StoreReader) -> list[ValidationRound]:
    """Every validation round found in the store (ids ``v<step>-...``), by step."""
    rows = reader.db.execute(
        "SELECT r.rollout_id, r.state, json_extract(a.body, '$.status'), json_extract(a.body, '$.total_reward')"
        " FROM rollouts r LEFT JOIN assembled a ON a.rollout_id = r.rollout_id"
        " WHERE r.rollout_id GLOB 'v[0-9]*-*'").fetchall()
    grouped: dict[int, list] = defaultdict(list)
    for rollout_id, state, status, reward in rows:
        number = rollout_id[1:].split("-", 1)[0]
        if number.isdigit():
            grouped[int(number)].append((state, status, reward))
    rounds = []
    for step in sorted(grouped):
        items = grouped[step]
        rewards = [reward for _, _, reward in items if reward is not None]
        rounds.append(ValidationRound(
            step, len(items), sum(1 for state, _, _ in items if state == "assembled"),
            sum(1 for _, status, _ in items if status == "ok"),
            sum(rewards) / len(rewards) if rewards else None))
    return rounds


def store_counts(reader: StoreReader) -> dict[str, int]:
    """Rollouts by the receiver's state (open, assembled, broken) and in all."""
    counts = dict(reader.db.execute("SELECT state, count(*) FROM rollouts GROUP BY state").fetchall())
    counts["all"] = sum(counts.values())
    return counts


def trained_version(reader: StoreReader) -> tuple[int, int]:
    """Changes whenever the trainer records rollouts (a row written or rewritten gets a new rowid)."""
    if not reader.trained:
        return (0, 0)
    newest, count = reader.db.execute(f"SELECT coalesce(max(rowid), 0), count(*) FROM {TRAINED_TABLE}").fetchone()
    return int(newest), int(count)


def training_steps(reader: StoreReader) -> list[int]:
    """The steps the trainer scored rollouts at (from ``trained_rollouts``)."""
    if not reader.trained:
        return []
    return [s for s, in reader.db.execute(f"SELECT DISTINCT step FROM {TRAINED_TABLE} ORDER BY step")]


def task_ids(reader: StoreReader, limit: int = 500) -> list[str]:
    """Task ids for the filters' suggestions (at most ``limit``; from the facet index when
    attached: its task index answers without reading the whole rollouts table)."""
    table = "ix.facets" if reader.indexed else "rollouts"
    return [t for t, in reader.db.execute(
        f"SELECT DISTINCT task_id FROM {table} WHERE task_id IS NOT NULL ORDER BY task_id LIMIT ?", (limit,))]


def step_suggestions(reader: StoreReader) -> list[int]:
    """Steps for the filters' suggestions: every step with a round (index) or a trained rollout."""
    if reader.indexed:
        query = "SELECT DISTINCT step FROM ix.facets WHERE step IS NOT NULL ORDER BY step"
        return [s for s, in reader.db.execute(query)]
    return training_steps(reader)


def steps_of_task(reader: StoreReader, task: str) -> list[int]:
    """The training steps whose rounds ran ``task``."""
    steps = set()
    for rollout_id, in reader.db.execute(
            "SELECT rollout_id FROM rollouts WHERE task_id = ? AND rollout_id GLOB 's[0-9]*-*'", (task,)):
        found = step_of_rollout(rollout_id)
        if found is not None:
            steps.add(found[1])
    return sorted(steps)
