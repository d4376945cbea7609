"""Asynchronous training (``async_training: true``): groups are taken as they finish, stale
rollouts are counted and dropped or kept by the setting, and the calculator agent trains to the
synchronous loop's reward in a short ``spanrl demo``.

The dispatcher is driven over the real bridge HTTP API by ``BridgeClient`` (what runners use);
the demo runs the real receiver and runner processes, as ``test_loop_demo_short``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

import pytest

from spanrl.errors import SettingError
from spanrl.runner.bridge_client import BridgeClient
from spanrl.schema.metrics import read_metrics
from spanrl.schema.rollouts import Transition
from spanrl.schema.scored import ScoredRollout
from spanrl.trainer_bridge.async_training import GroupDispatcher, filter_stale, rollout_lag
from spanrl.trainer_bridge.bridge_api import BridgeAPI, PolicyInfo
from spanrl.trainer_bridge.task_dispatch import Attempt
from spanrl.trainer_bridge.train_settings import TrainSettings

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")


@pytest.fixture
def group_bridge():
    dispatcher = GroupDispatcher(rollout_timeout_s=30.0)
    api = BridgeAPI(dispatcher, PolicyInfo("http://127.0.0.1:9/v1", "policy"), lambda: 0, port=0).start()
    try:
        yield dispatcher, BridgeClient(api.url)
    finally:
        dispatcher.close()
        api.stop()


def test_finished_groups_are_taken_while_others_still_run(group_bridge):
    dispatcher, client = group_bridge
    dispatcher.add_groups(0, [("a", {"q": 1}), ("b", {"q": 2}), ("c", {"q": 3})], group_size=2, policy_version=0)
    claimed = [client.claim() for _ in range(6)]
    assert all(claimed) and client.claim() is None
    by_task: dict[str, list[str]] = {}
    for attempt in claimed:
        assert attempt is not None
        by_task.setdefault(attempt.task_id, []).append(attempt.rollout_id)
    for rollout_id in by_task["c"] + by_task["a"][:1]:  # c finished, a half, b still running
        client.finish(rollout_id, "ok")
    taken = dispatcher.take_finished_groups(1, poll_s=0.05)
    assert [g.attempts[0].task_id for g in taken] == ["c"]
    assert set(taken[0].outcomes) == set(by_task["c"])
    assert dispatcher.groups_in_flight == 2
    # a new group joins the running ones; b's runner reports later
    dispatcher.add_groups(1, [("d", {"q": 4})], group_size=2, policy_version=1)
    assert dispatcher.groups_in_flight == 3
    for rollout_id in by_task["b"] + by_task["a"][1:]:
        client.finish(rollout_id, "ok")
    taken = dispatcher.take_finished_groups(2, poll_s=0.05)
    assert sorted(g.attempts[0].task_id for g in taken) == ["a", "b"]
    assert not dispatcher.knows(by_task["a"][0]) and dispatcher.groups_in_flight == 1
    second = client.claim()
    assert second is not None and second.task_id == "d" and second.step == 1


def transition(rollout_id: str, index: int, version: int | None) -> Transition:
    return Transition(rollout_id=rollout_id, index=index, span_id=f"{rollout_id}-{index}", agent_name=None,
                      prompt_token_ids=(1, 2), response_token_ids=(3,), response_logprobs=(-1.0,), choice_index=0,
                      policy_version=version, reward=0.0, return_=0.0, retokenized=False)


def scored(rollout_id: str, *versions: int | None) -> ScoredRollout:
    attempt = Attempt(rollout_id, "t", 0, {}, 0)
    return ScoredRollout(attempt, 1.0, tuple(transition(rollout_id, i, v) for i, v in enumerate(versions)))


def test_stale_rollouts_are_counted_and_corrected_or_dropped():
    rollouts = [scored("fresh", 3, 3), scored("crossed", 2, 3), scored("behind", 2), scored("too_old", 1, 3),
                scored("unknown", None)]
    dispatch = {"unknown": 1}  # the engine gave no version: the one at dispatch counts
    assert rollout_lag(rollouts[3].transitions, 0, 3) == 2
    corrected = filter_stale(rollouts, dispatch, current_version=3, max_staleness=1, off_policy_rollouts="correct")
    assert [r.attempt.rollout_id for r in corrected.kept] == ["fresh", "crossed", "behind"]
    assert (corrected.off_policy, corrected.stale_dropped, corrected.off_policy_dropped) == (4, 2, 0)
    dropped = filter_stale(rollouts, dispatch, current_version=3, max_staleness=1, off_policy_rollouts="drop")
    assert [r.attempt.rollout_id for r in dropped.kept] == ["fresh"]
    assert (dropped.off_policy, dropped.stale_dropped, dropped.off_policy_dropped) == (4, 2, 2)
    assert dropped.lag_mean == pytest.approx((0 + 1 + 1 + 2 + 2) / 5)


def test_async_settings_set_the_trainers_correction_and_refuse_what_cannot_run():
    settings = TrainSettings(tasks="t.jsonl", model="m", async_training=True, is_truncation=3.0)
    assert settings.trainer.rollout_is_cap == 3.0
    assert TrainSettings(tasks="t.jsonl", model="m", async_training=True,
                         off_policy_rollouts="drop").trainer.rollout_is_cap == 0.0
    assert TrainSettings(tasks="t.jsonl", model="m").trainer.rollout_is_cap == 0.0
    with pytest.raises(SettingError, match="off_policy_rollouts"):
        TrainSettings(tasks="t.jsonl", model="m", off_policy_rollouts="maybe")
    # verl corrects with its own truncated IS (verl_backend/off_policy.py): the same cap reaches it
    verl = TrainSettings(tasks="t.jsonl", model="m", backend="verl", async_training=True, is_truncation=3.0)
    assert verl.backend_run().algorithm.rollout_is_cap == 3.0
    with pytest.raises(SettingError, match="max_staleness"):
        TrainSettings(tasks="t.jsonl", model="m", max_staleness=-1)
    assert TrainSettings(tasks="t.jsonl", model="m", async_training=True, val_tasks="v.jsonl").val_tasks == "v.jsonl"


def run_demo(out, model: str, *extra: str) -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-m", "spanrl", "demo", "--output-dir", str(out), "--model", model,
         "--steps", "6", "--tasks-per-step", "8", "--group-size", "4", "--concurrency", "8",
         "--stop-at-reward", "2", "--device", TEST_DEVICE, *extra],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return read_metrics(out / "run")


# two short demos from the same warm model
@pytest.mark.timeout(1800)
def test_async_demo_with_staleness_one_reaches_the_sync_reward(tmp_path, weak_calc_model):
    sync_rows = run_demo(tmp_path / "sync", weak_calc_model)
    async_rows = run_demo(tmp_path / "async", weak_calc_model, "--async-training", "--max-staleness", "1")
    assert [r["actor/policy_version"] for r in async_rows] == [1, 2, 3, 4, 5, 6]
    for row in async_rows:
        assert row["rollout/count"] == 32 and row["actor/transitions"] > 0
        assert "rollout/off_policy" in row and "rollout/policy_lag_mean" in row
    # groups ran across updates: some rollouts were generated by an older policy and counted
    assert sum(r["rollout/off_policy"] for r in async_rows) > 0
    assert all(r["rollout/policy_lag_mean"] <= 1.0 + 1e-9 or r["rollout/left_out"].get("stale") for r in async_rows)
    assert any("actor/rollout_is_mean" in r for r in async_rows)  # the correction ran
    sync_reward = statistics.mean(r["rollout/reward_mean"] for r in sync_rows)
    async_reward = statistics.mean(r["rollout/reward_mean"] for r in async_rows)
    # 192 rollouts each, rewards in [0, 1]. Async trains on the groups that finish first, not a
    # fair sample of the step's tasks, and its rollout mean ran a little below sync's (4 pairs on
    # an idle machine: -0.08, -0.10, -0.05, +0.09; with 64 rollouts a CI run under load saw -0.22).
    # 0.25 lower is beyond that and the noise; a run that stops learning or collapses falls below.
    assert async_reward > sync_reward - 0.25, (sync_reward, async_reward)
