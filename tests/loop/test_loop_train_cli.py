"""``spanrl train`` as a user runs it: waiting for runners, the summary at the end, TensorBoard.

Real processes: ``spanrl receive``, ``spanrl train`` (tiny model, embedded torch backend,
``report_to: [tensorboard]``) and, only once the trainer said it waits for runners, ``spanrl
run`` with the calculator agent. Checked: the "waiting for runners" line names the bridge URL
to give ``spanrl run``; the end-of-training summary (steps, best reward and its step, where the
checkpoints, metrics, plot and TensorBoard files are) matches what was written.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from spanrl.child_processes import free_port
from spanrl.demo import CALC_AGENT, CALC_REWARD
from spanrl.schema.metrics import read_metrics
from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wait_for_text(path, text: str, process: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        assert process.poll() is None, f"exited {process.returncode} before saying {text!r}:\n{content[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not said within {timeout_s} s")


def test_train_waits_for_runners_then_summarises_where_results_are(tmp_path):
    import tensorboard  # noqa: F401 - the trainer reports to it below; CI installs it

    model = create_model_dir(tmp_path / "model", preset="tiny", seed=0)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"q{n}", "question": f"{n}+1", "answer": n + 1}) + "\n"
                             for n in range(2)))
    db, run_dir = tmp_path / "spanrl.db", tmp_path / "run"
    grpc_port, bridge_port = free_port(), free_port()
    config = tmp_path / "train.yaml"
    config.write_text(json.dumps({
        "tasks": str(tasks), "model": str(model), "output_dir": str(run_dir), "store": str(db),
        "reward": CALC_REWARD, "group_size": 2, "tasks_per_step": 1, "steps": 2, "checkpoint_every": 0,
        "policy_port": 0, "bridge_port": bridge_port, "device": TEST_DEVICE, "rollout_timeout_s": 60,
        "report_to": ["tensorboard"], "runner_wait_warn_s": 1.0,
    }))  # JSON is YAML
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_SPANRL_")}
    logs = {name: tmp_path / f"{name}.log" for name in ("receiver", "train", "runner")}
    processes: list[subprocess.Popen] = []

    def start(name: str, *argv: str) -> subprocess.Popen:
        with open(logs[name], "w") as log:
            process = subprocess.Popen([sys.executable, "-m", "spanrl", *argv], stdout=log,
                                       stderr=subprocess.STDOUT, env=clean, cwd=REPO)
        processes.append(process)
        return process

    try:
        receiver = start("receiver", "receive", "--db", str(db), "--grpc-port", str(grpc_port),
                         "--http-port", "0", "--grace-s", "0.3")
        wait_for_text(logs["receiver"], "spanrl receive: ready", receiver, 60)
        train = start("train", "train", str(config))
        said = wait_for_text(logs["train"], "waiting for runners", train, 240)
        start("runner", "run", "--agent", CALC_AGENT, "--bridge-url", f"http://127.0.0.1:{bridge_port}",
              "--otlp-endpoint", f"http://127.0.0.1:{grpc_port}", "--concurrency", "2")
        assert train.wait(300) == 0, logs["train"].read_text()[-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
                process.wait(30)

    waiting = next(line for line in said.splitlines() if "waiting for runners" in line)
    assert re.search(r"waiting for runners: no runner has claimed a task for \d+ s \(2 attempts wait\); "
                     rf"start `spanrl run RUN.yaml` with bridge_url: http://127.0.0.1:{bridge_port}$", waiting), waiting

    rows = read_metrics(run_dir)
    best = max(rows, key=lambda r: r["rollout/reward_mean"])
    output = logs["train"].read_text()
    summary = output[output.index("spanrl train: finished"):].splitlines()
    reward = "rollout/reward_mean"
    assert summary[0] == (f"spanrl train: finished 2 steps (policy version 2); reward {rows[0][reward]:.2f} "
                          f"-> {rows[1][reward]:.2f}, best {best[reward]:.2f} at step {best['step']}")
    places = {name: where.strip() for name, where in (line.strip().split(": ", 1) for line in summary[1:7])}
    assert places["checkpoints"] == str(run_dir / "checkpoints") and os.listdir(places["checkpoints"])
    assert os.path.isfile(os.path.join(places["last checkpoint"], "config.json"))
    assert places["metrics"] == str(run_dir / "metrics.jsonl")
    assert places["plot"] == str(run_dir / "reward_curve.png") and os.path.getsize(places["plot"]) > 0
    assert places["tensorboard"] == str(run_dir / "tensorboard")

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(places["tensorboard"])
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("rollout/reward_mean")] == [
        (r["step"], round(r["rollout/reward_mean"], 6)) for r in rows]
