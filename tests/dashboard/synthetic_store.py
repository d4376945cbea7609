"""A span store of many assembled rollouts, written fast: for the dashboard's paging tests and
``bench/bench_dashboard.py`` (10^5 rollouts), where a real run would take hours.

The schema is the receiver's own (``SpanStore`` creates it); each rollout's body is
``rollout_to_dict`` of a real ``AssembledRollout``, its bookkeeping row the one ``count_new_spans`` keeps,
and the trainer's records go through ``trained_rewards.record``. Only the bulk inserts are ours
(one transaction for all rows instead of one per rollout). Rollouts have no spans.
"""

from __future__ import annotations

import json
import random
import sqlite3
import time
from pathlib import Path

from spanrl.otlp_receiver import trained_rewards
from spanrl.otlp_receiver.store import SpanStore
from spanrl.schema.rollouts import AssembledRollout, Reward, Transition, rollout_to_dict

AGENTS = ("planner", "writer")


def synthetic_rollout(step: int, task: int, attempt: int, sequence: int, rng: random.Random,
                      prompt_tokens: int = 120, response_tokens: int = 24) -> AssembledRollout:
    rollout_id = f"s{step - 1}-t{task}-a{attempt}-{sequence:08x}"
    failed = rng.random() < 0.05
    transitions = tuple(
        Transition(rollout_id=rollout_id, index=index, span_id=f"{sequence:08x}{index:08x}", agent_name=agent,
                   prompt_token_ids=tuple(rng.randrange(300) for _ in range(prompt_tokens)),
                   response_token_ids=tuple(rng.randrange(300) for _ in range(response_tokens)),
                   response_logprobs=tuple(-rng.random() * 3 for _ in range(response_tokens)),
                   choice_index=0, policy_version=step - 1, reward=0.0, return_=0.0, retokenized=False)
        for index, agent in enumerate(AGENTS)
    )
    reward = round(rng.random(), 3)
    return AssembledRollout(
        rollout_id=rollout_id, task_id=f"t{task}", attempt=attempt, status="failed" if failed else "ok",
        error="agent crashed" if failed else None, end_reason="rollout_span", total_reward=reward,
        rewards=(Reward("score", reward, "spanrl.reward", transitions[-1].span_id, transitions[-1].span_id),),
        variables={"output": str(task)}, transitions=transitions, problems=(), sequence=sequence,
    )


def build_store(path: Path, rollouts: int, tasks_per_step: int = 16, group_size: int = 8, seed: int = 0,
                prompt_tokens: int = 120, response_tokens: int = 24) -> list[AssembledRollout]:
    """Write ``rollouts`` assembled training rollouts (steps of ``tasks_per_step`` x
    ``group_size``) and the trainer's record of each ok one; returns them (small n only: the
    list holds every body)."""
    SpanStore(path).close()  # the receiver's schema
    rng = random.Random(seed)
    per_step = tasks_per_step * group_size
    made: list[AssembledRollout] = []
    db = sqlite3.connect(str(path), isolation_level=None)
    trained = []
    now = time.time()
    db.execute("BEGIN")
    for sequence in range(1, rollouts + 1):
        step, within = divmod(sequence - 1, per_step)
        rollout = synthetic_rollout(step + 1, within // group_size, within % group_size, sequence, rng,
                                    prompt_tokens, response_tokens)
        db.execute("INSERT INTO rollouts (rollout_id, task_id, attempt, first_seen, last_seen, span_count, state)"
                   " VALUES (?, ?, ?, ?, ?, 3, 'assembled')",
                   (rollout.rollout_id, rollout.task_id, rollout.attempt, now + sequence, now + sequence))
        db.execute("INSERT INTO assembled (sequence, rollout_id, assembled_at, body) VALUES (?, ?, ?, ?)",
                   (sequence, rollout.rollout_id, now + sequence, json.dumps(rollout_to_dict(rollout))))
        if rollout.status == "ok":
            trained.append(trained_rewards.TrainedRollout(
                rollout.rollout_id, step + 1, rollout.total_reward or 0.0, "events: spanrl.reward",
                {1: rollout.total_reward or 0.0}, True, {1: round(rng.uniform(-1, 1), 4)}))
        if rollouts <= 10_000:
            made.append(rollout)
    db.execute("COMMIT")
    db.close()
    trained_rewards.record(path, trained)
    return made
