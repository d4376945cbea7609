"""`spanrl demo --backend verl` on CPU: the calculator agent trained for 2 steps by verl's workers,
its calls served by vLLM through the gateway, every part a real process (receiver, runner,
agents, Ray workers, vLLM)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spanrl.otlp_receiver.store import SpanStore
from spanrl.schema.metrics import read_metrics


@pytest.mark.timeout(1200)
def test_demo_trains_two_steps_on_verl_with_agents_served_by_vllm(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "spanrl", "demo", "--backend", "verl", "--output-dir", str(out),
         "--sft-steps", "60", "--steps", "2", "--tasks-per-step", "2", "--group-size", "4",
         "--concurrency", "8", "--stop-at-reward", "2"],
        capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    rows = read_metrics(out / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["actor/policy_version"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/count"] == 8 and row["actor/transitions"] > 0
        # the step's parts, measured by the verl backend
        assert row["actor/update_s"] > 0 and row["actor/weight_sync_s"] > 0

    # every call was served by vLLM behind the gateway with the engine's ids, and the second
    # step's calls by the weights the first verl update synced into it
    store = SpanStore(str(out / "spanrl.db"))
    rollouts, _ = store.completed_rollouts(since=0)
    assert len(rollouts) == 16
    served_versions: dict[int, set[int]] = {0: set(), 1: set()}
    for rollout in rollouts:
        assert rollout.status == "ok", rollout.problems
        for transition in rollout.transitions:
            assert transition.prompt_token_ids and transition.response_token_ids
            assert not transition.retokenized
            served_versions[int(rollout.rollout_id.split("-")[0][1:])].add(transition.policy_version)
    assert served_versions == {0: {0}, 1: {1}}

    # verl's own checkpoint, with the Hugging Face model beside it
    checkpoints = sorted((out / "run" / "checkpoints").glob("step-*"))
    assert checkpoints and (checkpoints[-1] / "actor" / "huggingface" / "config.json").exists()
