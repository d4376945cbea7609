"""A short `spanrl demo`: the whole loop through real processes, two GRPO steps.

Receiver and runner are child processes, the agent is the plain OpenAI-SDK calculator agent,
spans travel over OTLP/gRPC. The test reads what the run left behind: the receiver's store,
metrics.jsonl and the checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from spanrl.otlp_receiver.store import SpanStore
from spanrl.schema.metrics import read_metrics

# where the model runs: cpu, or cuda on a GPU machine (docs/gpu.md)
TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")


@pytest.mark.timeout(600)
def test_short_demo_trains_on_transitions_from_received_spans(tmp_path, weak_calc_model):
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "spanrl", "demo", "--output-dir", str(out), "--model", weak_calc_model,
         "--steps", "2", "--tasks-per-step", "4", "--group-size", "4", "--concurrency", "8",
         "--stop-at-reward", "2", "--device", TEST_DEVICE],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "mean reward" in result.stdout and "no warm start" in result.stdout

    rows = read_metrics(out / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["actor/policy_version"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/count"] == 16 and row["actor/transitions"] > 0
        for key in ("rollout/reward_mean", "actor/policy_version", "actor/transitions", "step"):
            assert key in row
    assert (out / "run" / "reward_curve.png").stat().st_size > 1000

    # Transitions came from spans the receiver stored: every rollout of both steps assembled
    # from the rollout span, with engine token ids, and the second step's calls were served
    # by the policy the first update published.
    store = SpanStore(str(out / "spanrl.db"))
    rollouts, _ = store.completed_rollouts(since=0)
    assert len(rollouts) == 32
    served_versions = {0: set(), 1: set()}
    for rollout in rollouts:
        assert rollout.status == "ok" and rollout.end_reason == "rollout_span"
        assert rollout.transitions, rollout.problems
        step = int(rollout.rollout_id.split("-")[0][1:])
        for transition in rollout.transitions:
            assert transition.prompt_token_ids and transition.response_token_ids
            assert not transition.retokenized
            served_versions[step].add(transition.policy_version)
        assert "output" in rollout.variables
    assert served_versions == {0: {0}, 1: {1}}

    # The weights changed: the final checkpoint differs from the warm start.
    checkpoints = sorted((out / "run" / "checkpoints").iterdir())
    warm = load_file(os.path.join(weak_calc_model, "model.safetensors"))
    final = load_file(str(checkpoints[-1] / "model.safetensors"))
    changed = [name for name in warm if not (warm[name] == final[name]).all()]
    assert changed, "GRPO steps left every weight unchanged"
    assert os.path.exists(checkpoints[-1] / "config.json")
