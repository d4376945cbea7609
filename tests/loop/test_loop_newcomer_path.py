"""The README's own-agent path, run as a user runs it: the ``spanrl`` console script in a fresh
folder, one command after another (init, model init, sft, receive + train + run for 2 steps,
inspect), on the embedded backend. Every process started here is stopped here.

Kept small to stay fast: 2 tasks of 4 attempts per step, a short warm start.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spanrl.child_processes import free_port
from spanrl.schema.metrics import read_metrics

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
SPANRL = [shutil.which("spanrl") or os.path.join(os.path.dirname(sys.executable), "spanrl")]


def spanrl(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run([*SPANRL, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"spanrl {' '.join(args)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def wait_for_port(port: int, process: subprocess.Popen, log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"port {port} not open after {timeout_s} s:\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.mark.timeout(900)
def test_own_agent_path_of_the_readme_trains_and_shows_rewards(tmp_path):
    project = tmp_path / "my-agent"
    spanrl(tmp_path, "init", "my-agent")
    for name in ("agent.py", "reward.py", "tasks.jsonl", "demonstrations.jsonl", "train.yaml", "run.yaml",
                 "README.md"):
        assert (project / name).is_file(), name

    spanrl(project, "model", "init", "model", "--corpus", "demonstrations.jsonl")
    sft = spanrl(project, "sft", "model", "--demonstrations", "demonstrations.jsonl", "--output", "model-warm",
                 "--steps", "40", "--batch-size", "16", "--device", TEST_DEVICE)
    losses = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+) over 40 steps", sft.stdout)
    assert losses, sft.stdout
    assert float(losses.group(2)) < float(losses.group(1))
    assert "sft:" in sft.stderr  # the progress bar
    assert (project / "model-warm" / "config.json").is_file()

    grpc_port, http_port, policy_port, bridge_port = (free_port() for _ in range(4))
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("receive", "train", "run")}
    processes: list[subprocess.Popen] = []
    try:
        receive = subprocess.Popen(
            [*SPANRL, "receive", "--db", "spanrl.db", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
             "--grace-s", "0.3"], cwd=project, stdout=logs["receive"], stderr=subprocess.STDOUT)
        processes.append(receive)
        wait_for_port(grpc_port, receive, tmp_path / "receive.log")
        train = subprocess.Popen(
            [*SPANRL, "train", "train.yaml", "--steps", "2", "--tasks-per-step", "2", "--group-size", "4",
             "--policy-port", str(policy_port), "--bridge-port", str(bridge_port), "--device", TEST_DEVICE],
            cwd=project, stdout=logs["train"], stderr=subprocess.STDOUT)
        processes.append(train)
        run = subprocess.Popen(
            [*SPANRL, "run", "run.yaml", "--bridge-url", f"http://127.0.0.1:{bridge_port}",
             "--otlp-endpoint", f"http://127.0.0.1:{grpc_port}", "--concurrency", "8"],
            cwd=project, stdout=logs["run"], stderr=subprocess.STDOUT)
        processes.append(run)
        assert train.wait(timeout=600) == 0, (tmp_path / "train.log").read_text()[-4000:]
        assert run.wait(timeout=60) == 0, (tmp_path / "run.log").read_text()[-4000:]
    finally:
        for process in reversed(processes):
            stop(process)
        for log in logs.values():
            log.close()

    rows = read_metrics(project / "runs" / "train")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["rollout/count"] == 8 and row["actor/transitions"] > 0, row
        assert 0.0 <= row["rollout/reward_mean"] <= 1.0, row

    shown = spanrl(project, "inspect", "rollouts", "--db", "spanrl.db").stdout
    rewards = table_column(shown, "reward")
    assert len(rewards) == 16, shown  # 2 steps x 2 tasks x 4 attempts
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", value) for value in rewards), shown


def table_column(text: str, name: str) -> list[str]:
    """The cells of column ``name`` of a table printed by ``spanrl inspect`` (header, dashes, rows)."""
    lines = [line for line in text.splitlines() if line.strip()]
    dashes = next(i for i, line in enumerate(lines) if set(line.replace(" ", "")) == {"-"})
    spans = [m.span() for m in re.finditer(r"-+", lines[dashes])]
    headers = [lines[dashes - 1][a:b].strip() for a, b in spans]
    start, end = spans[headers.index(name)]
    return [line[start:end].strip() for line in lines[dashes + 1:]]
