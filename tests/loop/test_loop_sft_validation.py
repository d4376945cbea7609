"""SFT from rollouts (``algorithm: sft``) and validation, through real processes.

``spanrl receive``, ``spanrl train`` (embedded torch backend) and ``spanrl run`` with the
calculator agent; the model is a tiny one given a short warm start (``weak_calc_model``,
tests/loop/conftest.py), so its agent succeeds on
some tasks only (a weak model). Checked: learning the calls of its rewarded rollouts raises
the training reward; the held-out tasks are scored every ``val_every`` steps (``val_reward``
in metrics.jsonl, TensorBoard and the plot) and their rollouts are never trained on;
each round's per-task scores land in ``validation.jsonl``;
``spanrl train --val-only --resume`` scores the run's newest checkpoint and prints it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from spanrl.child_processes import free_port
from spanrl.demo import CALC_AGENT, CALC_REWARD
from spanrl.schema.metrics import read_metrics

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, VAL_EVERY, VAL_TASKS = 8, 4, 16


def wait_for_text(path, text: str, process: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        assert process.poll() is None, f"exited {process.returncode} before saying {text!r}:\n{content[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not said within {timeout_s} s")


@pytest.mark.timeout(900)
def test_sft_from_rollouts_raises_the_reward_and_validation_is_scored_apart(tmp_path, weak_calc_model):
    import tensorboard  # noqa: F401 - report_to: [tensorboard] below; CI installs it

    from spanrl.examples.calc_agent.tasks import make_tasks
    from spanrl.otlp_receiver import trained_rewards
    from spanrl.otlp_receiver.store import SpanStore

    model = weak_calc_model
    tasks, val_tasks = tmp_path / "tasks.jsonl", tmp_path / "val.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in make_tasks(400, seed=1)))
    val_tasks.write_text("".join(json.dumps({**t, "id": f"val-{n}"}) + "\n"
                                 for n, t in enumerate(make_tasks(VAL_TASKS, seed=2))))
    db, run_dir = tmp_path / "spanrl.db", tmp_path / "run"
    grpc_port, bridge_port = free_port(), free_port()
    config = tmp_path / "train.yaml"
    config.write_text(json.dumps({
        "tasks": str(tasks), "model": model, "output_dir": str(run_dir), "store": str(db),
        "reward": CALC_REWARD, "algorithm": "sft", "sft_min_reward": 1.0, "group_size": 4, "tasks_per_step": 16,
        "steps": STEPS, "learning_rate": 5e-4, "checkpoint_every": 0, "policy_port": 0, "bridge_port": bridge_port,
        "device": TEST_DEVICE, "rollout_timeout_s": 60, "report_to": ["tensorboard"], "val_tasks": str(val_tasks),
        "val_every": VAL_EVERY, "val_attempts": 2, "max_empty_steps": 0,
    }))  # JSON is YAML
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_SPANRL_")}
    logs = {name: tmp_path / f"{name}.log" for name in ("receiver", "train", "runner", "val", "runner-val")}
    processes: list[subprocess.Popen] = []

    def start(name: str, *argv: str) -> subprocess.Popen:
        with open(logs[name], "w") as log:
            process = subprocess.Popen([sys.executable, "-m", "spanrl", *argv], stdout=log,
                                       stderr=subprocess.STDOUT, env=clean, cwd=REPO)
        processes.append(process)
        return process

    def runner(name: str) -> None:
        start(name, "run", "--agent", CALC_AGENT, "--bridge-url", f"http://127.0.0.1:{bridge_port}",
              "--otlp-endpoint", f"http://127.0.0.1:{grpc_port}", "--concurrency", "8", "--bridge-wait-s", "300")

    try:
        receiver = start("receiver", "receive", "--db", str(db), "--grpc-port", str(grpc_port),
                         "--http-port", "0", "--grace-s", "0.3")
        wait_for_text(logs["receiver"], "spanrl receive: ready", receiver, 60)
        train = start("train", "train", str(config))
        runner("runner")
        assert train.wait(600) == 0, logs["train"].read_text()[-3000:]
        # the run's newest checkpoint, scored alone
        validate = start("val", "train", str(config), "--val-only", "--resume")
        runner("runner-val")
        assert validate.wait(300) == 0, logs["val"].read_text()[-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
                process.wait(30)

    rows = read_metrics(run_dir)
    rewards = [r["rollout/reward_mean"] for r in rows]
    assert len(rows) == STEPS, rewards
    # learning its own rewarded calls raises the weak model's reward (measured once, loaded machine:
    # 0.36 0.34 0.50 0.56 0.67 0.52 0.72 over the first 7 steps)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:2]) / 2 + 0.1, rewards
    for row in rows:
        assert row["actor/transitions"] > 0 and row["rollout/below_sft_min_reward"] < row["rollout/count"], row
    validated = [r for r in rows if "val/reward" in r]
    assert [r["step"] for r in validated] == [VAL_EVERY, STEPS]
    for row in validated:
        assert row["val/count"] == VAL_TASKS * 2 and 0.0 <= row["val/reward"] <= 1.0, row

    # validation rollouts: in the store under their own prefix, scored, never trained on
    store = SpanStore(str(db))
    rollouts, _ = store.completed_rollouts(since=0)
    val_ids = {r.rollout_id for r in rollouts if r.rollout_id.startswith("v")}
    assert len(val_ids) >= VAL_TASKS * 2 * 2  # two rounds in training, one with --val-only
    assert all(re.match(r"v\d+-val-\d+-a\d-", rid) for rid in val_ids), sorted(val_ids)[:3]
    trained = trained_rewards.load(str(db))
    assert trained and not val_ids & trained.keys()

    # validation.jsonl: each round's score of every held-out task, the mean of its attempts' rewards
    rounds = [json.loads(line) for line in (run_dir / "validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rounds] == [VAL_EVERY, STEPS]
    val_by_id = {t["id"]: t for t in map(json.loads, val_tasks.read_text().splitlines())}
    for record, row in zip(rounds, validated, strict=True):
        assert set(record["task_scores"]) == set(val_by_id), record
        assert sum(record["task_scores"].values()) / VAL_TASKS == pytest.approx(row["val/reward"])
    from spanrl.examples.calc_agent.reward import reward

    first_round = [r for r in rollouts if r.rollout_id.startswith(f"v{VAL_EVERY}-val-")]
    assert len(first_round) == VAL_TASKS * 2
    for task_id, task in val_by_id.items():
        rewards = [reward(task, r.variables) for r in first_round if r.task_id == task_id]
        assert len(rewards) == 2 and rounds[0]["task_scores"][task_id] == pytest.approx(sum(rewards) / 2), task_id

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("val/reward")] == [
        (r["step"], round(r["val/reward"], 6)) for r in validated]

    said = logs["val"].read_text()
    line = next(x for x in said.splitlines() if x.startswith("spanrl train --val-only:"))
    match = re.match(r"spanrl train --val-only: val_reward ([\d.]+) over (\d+) of (\d+) rollouts "
                     rf"\(policy version {STEPS}\)", line)
    assert match, line
    saved = json.loads((run_dir / "validation.json").read_text())
    assert saved["rollouts"] == int(match.group(3)) == VAL_TASKS * 2
    assert round(saved["val_reward"], 4) == float(match.group(1))
    assert set(saved["task_scores"]) == {f"val-{n}" for n in range(VAL_TASKS)}
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == STEPS  # --val-only wrote no row
