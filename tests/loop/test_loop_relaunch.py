"""Relaunch of attempts that end as infrastructure faults (``relaunch_attempts``): timed out,
lost with their runner, or failed by the runner itself are re-opened as a new attempt of the
same task in the same group; an agent that ran and failed is not. Driven over the real bridge
HTTP API by ``BridgeClient`` (what runners use), for the synchronous round and the async groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from spanrl.errors import SettingError
from spanrl.runner.bridge_client import BridgeClient
from spanrl.trainer_bridge.async_training import GroupDispatcher
from spanrl.trainer_bridge.bridge_api import BridgeAPI, PolicyInfo
from spanrl.trainer_bridge.task_dispatch import Outcome, TaskDispatcher, is_infrastructure_fault
from spanrl.trainer_bridge.train_settings import TrainSettings


@contextmanager
def bridge_client(dispatcher: TaskDispatcher) -> Iterator[BridgeClient]:
    """A runner's client of ``dispatcher`` behind the real bridge API; both closed after."""
    api = BridgeAPI(dispatcher, PolicyInfo("http://127.0.0.1:9/v1", "policy"), lambda: 0, port=0).start()
    try:
        yield BridgeClient(api.url)
    finally:
        dispatcher.close()
        api.stop()


def test_the_infrastructure_fault_rule():
    assert is_infrastructure_fault(Outcome("timeout", "agent did not finish within 5 s"))
    assert is_infrastructure_fault(Outcome("lost", "no report from the runner within 15 s"))
    assert is_infrastructure_fault(Outcome("failed", "runner error: ConnectionError: refused"))
    assert not is_infrastructure_fault(Outcome("failed", "agent exited with status 3: about to crash"))
    assert not is_infrastructure_fault(Outcome("ok"))


def test_a_timed_out_attempt_is_relaunched_and_its_group_trains_whole():
    dispatcher = TaskDispatcher(rollout_timeout_s=30.0, relaunch_attempts=1)
    with bridge_client(dispatcher) as client:
        opened = dispatcher.open_round(0, [("slow", {"q": 1}), ("fast", {"q": 2})], group_size=2)
        claimed = [client.claim() for _ in range(4)]
        assert all(claimed) and client.claim() is None
        slow = [a for a in claimed if a is not None and a.task_id == "slow"]
        client.finish(slow[0].rollout_id, "timeout", "agent did not finish within 30 s")
        relaunched = client.claim()  # the relaunch is queued first
        assert relaunched is not None and relaunched.task_id == "slow" and relaunched.attempt == slow[0].attempt
        assert relaunched.rollout_id != slow[0].rollout_id
        client.finish(slow[0].rollout_id, "ok")  # a late report of the retired attempt is accepted, ignored
        for attempt in [a for a in claimed if a is not None and a is not slow[0]] + [relaunched]:
            client.finish(attempt.rollout_id, "ok")
        outcomes = dispatcher.wait_round(poll_s=0.05)
        attempts = dispatcher.round_attempts()
        assert len(attempts) == len(opened) == 4
        assert {o.status for o in outcomes.values()} == {"ok"} and set(outcomes) == {a.rollout_id for a in attempts}
        assert sorted(a.attempt for a in attempts if a.task_id == "slow") == [0, 1]
        assert dispatcher.relaunched() == {"timeout": 1}


def test_relaunches_are_bounded_and_a_failed_agent_is_not_relaunched():
    dispatcher = TaskDispatcher(rollout_timeout_s=30.0, relaunch_attempts=2)
    with bridge_client(dispatcher) as client:
        dispatcher.open_round(0, [("t", {"q": 1})], group_size=2)
        first, second = client.claim(), client.claim()
        assert first is not None and second is not None
        client.finish(second.rollout_id, "failed", "agent exited with status 3")  # the agent's own failure
        current = first
        for _ in range(3):  # a runner that cannot reach the endpoint, three times
            client.finish(current.rollout_id, "failed", "runner error: ConnectionError: refused")
            claimed = client.claim()
            if claimed is None:
                break
            current = claimed
        outcomes = dispatcher.wait_round(poll_s=0.05)
        assert dispatcher.relaunched() == {"failed": 2}
        assert sorted(o.status for o in outcomes.values()) == ["failed", "failed"]
        assert len(dispatcher.round_attempts()) == 2


def test_a_relaunched_attempt_stays_in_its_async_group():
    dispatcher = GroupDispatcher(rollout_timeout_s=30.0, relaunch_attempts=1)
    with bridge_client(dispatcher) as client:
        dispatcher.add_groups(0, [("a", {"q": 1}), ("b", {"q": 2})], group_size=2, policy_version=0)
        claimed = [client.claim() for _ in range(4)]
        assert all(claimed)
        a_first = next(c for c in claimed if c is not None and c.task_id == "a")
        client.finish(a_first.rollout_id, "timeout", "too slow")
        for attempt in claimed:
            if attempt is not None and attempt is not a_first:
                client.finish(attempt.rollout_id, "ok")
        taken = dispatcher.take_finished_groups(1, poll_s=0.05)
        assert [g.attempts[0].task_id for g in taken] == ["b"]  # a waits for its relaunched member
        relaunched = client.claim()
        assert relaunched is not None and relaunched.task_id == "a"
        client.finish(relaunched.rollout_id, "ok")
        taken = dispatcher.take_finished_groups(1, poll_s=0.05)
        assert len(taken) == 1 and len(taken[0].attempts) == 2
        assert {o.status for o in taken[0].outcomes.values()} == {"ok"}
        assert relaunched.rollout_id in taken[0].outcomes and dispatcher.relaunched() == {"timeout": 1}


def test_relaunch_attempts_must_not_be_negative():
    assert TrainSettings(tasks="t.jsonl", model="m").relaunch_attempts == 1
    with pytest.raises(SettingError, match="relaunch_attempts must be 0 or more"):
        TrainSettings(tasks="t.jsonl", model="m", relaunch_attempts=-1)


def test_a_validation_round_runs_among_async_groups_and_is_never_trained():
    import threading

    dispatcher = GroupDispatcher(rollout_timeout_s=30.0)
    with bridge_client(dispatcher) as client:
        dispatcher.add_groups(0, [("train", {"q": 1})], group_size=2, policy_version=0)
        result: dict = {}
        validation = threading.Thread(target=lambda: result.update(
            round=dispatcher.run_round(1, [("held", {"q": 9})], 2, "v")))
        validation.start()
        claimed = []
        while len(claimed) < 4:  # the validation attempts are claimed first
            attempt = client.claim()
            if attempt is not None:
                claimed.append(attempt)
        assert [a.task_id for a in claimed[:2]] == ["held", "held"] and claimed[0].rollout_id.startswith("v1-")
        assert dispatcher.groups_in_flight == 1  # validation groups are not training groups
        for attempt in claimed:
            client.finish(attempt.rollout_id, "ok")
        validation.join(10)
        attempts, outcomes = result["round"]
        assert {a.task_id for a in attempts} == {"held"} and len(outcomes) == 2
        taken = dispatcher.take_finished_groups(5, poll_s=0.05)
        assert [g.attempts[0].task_id for g in taken] == ["train"] and dispatcher.groups_in_flight == 0


def test_admission_is_paced_by_the_groups_about_to_go_stale():
    from spanrl.trainer_bridge.async_training import groups_to_open

    assert groups_to_open(4, 0, [], 0, 1) == 4
    assert groups_to_open(4, 2, [3, 3], 3, 1) == 2  # on-policy groups running: fill up to capacity
    assert groups_to_open(4, 2, [3], 3, 1) == 2  # a finished group waiting to train holds nothing back
    assert groups_to_open(4, 2, [2, 3], 3, 1) == 1  # the version-2 group is one update from stale
    assert groups_to_open(4, 2, [1, 2], 3, 1) == 0
    assert groups_to_open(2, 1, [2], 3, 0) == 0  # max_staleness 0: a running group behind holds one back


def test_groups_are_taken_oldest_first_and_report_their_versions():
    dispatcher = GroupDispatcher(rollout_timeout_s=30.0)
    with bridge_client(dispatcher) as client:
        dispatcher.add_groups(0, [("old", {"q": 1})], group_size=1, policy_version=0)
        dispatcher.add_groups(1, [("new", {"q": 2})], group_size=1, policy_version=1)
        assert dispatcher.versions_running() == [0, 1]
        claimed = [client.claim(), client.claim()]
        for attempt in reversed(claimed):  # the newer group ends first
            assert attempt is not None
            client.finish(attempt.rollout_id, "ok")
            if attempt is claimed[1]:
                assert dispatcher.versions_running() == [0]
        taken = dispatcher.take_finished_groups(2, poll_s=0.05)
        assert [g.attempts[0].task_id for g in taken] == ["old", "new"]
        assert [g.dispatched_at_version for g in taken] == [0, 1]
