"""A real short training run for the dashboard's tests, as a user starts one: ``spanrl receive``
(default AIR rules), ``spanrl train`` (tiny model, torch backend, reward events, ``agents:
[writer]``, a validation round every 2 steps) and ``spanrl run`` with the two-agent test agent
(``agents/two_agents.py``); then ``spanrl dashboard`` over the store and the output folder.

Training rollouts of step ``gate_step`` and later wait for a gate file, so a test can watch the
run page while that step happens (``open_gate``). Every process is stopped by ``stop``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from spanrl.child_processes import free_port

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
REPO = Path(__file__).resolve().parents[2]
AGENTS = Path(__file__).resolve().parent / "agents"
TASKS = [{"id": "q0", "question": "2+3", "tool": "broken"}, {"id": "q1", "question": "4+4"}]
VAL_TASKS = [{"id": "v0", "question": "1+1"}]


def wait_for_text(path: Path, text: str, process: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        if process.poll() is not None:
            raise AssertionError(f"exited {process.returncode} before saying {text!r}:\n{content[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not said within {timeout_s} s:\n{path.read_text()[-3000:]}")


@dataclass
class TrainingRun:
    root: Path
    steps: int
    gate_step: int
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    dashboard_url: str = ""

    @property
    def store(self) -> Path:
        return self.root / "spanrl.db"

    @property
    def output_dir(self) -> Path:
        return self.root / "run"

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def gate(self) -> Path:
        return self.root / "gate"

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def start(self, name: str, *argv: str, env: dict | None = None) -> subprocess.Popen:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_SPANRL_")}
        with open(self.log(name), "w") as log:
            process = subprocess.Popen([sys.executable, "-m", "spanrl", *argv], stdout=log, stderr=subprocess.STDOUT,
                                       env={**clean, **(env or {})}, cwd=REPO)
        self.processes[name] = process
        return process

    def metrics_rows(self) -> list[dict]:
        path = self.output_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_steps(self, count: int, timeout_s: float) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = self.metrics_rows()
            if len(rows) >= count:
                return rows
            train = self.processes["train"]
            if train.poll() is not None:
                log = self.log("train").read_text()[-4000:]
                raise AssertionError(f"spanrl train exited {train.returncode}:\n{log}")
            time.sleep(0.2)
        raise AssertionError(f"{count} steps not done in {timeout_s} s:\n{self.log('train').read_text()[-4000:]}")

    def open_gate(self) -> None:
        self.gate.touch()

    def stop(self) -> None:
        self.open_gate()
        train = self.processes.get("train")
        if train is not None and train.poll() is None:
            try:
                train.wait(120)
            except subprocess.TimeoutExpired:
                pass
        for process in reversed(list(self.processes.values())):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)


def start_training_run(root: Path, steps: int = 3, gate_step: int = 3) -> TrainingRun:
    """Start receiver, trainer and runner; return once the steps before the gate are done and
    the dashboard serves them."""
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

    run = TrainingRun(root, steps, gate_step)
    create_model_dir(run.model_dir, preset="tiny", seed=0)
    (root / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    (root / "val.jsonl").write_text("".join(json.dumps(t) + "\n" for t in VAL_TASKS))
    grpc_port, bridge_port = free_port(), free_port()
    (root / "train.yaml").write_text(json.dumps({
        "tasks": str(root / "tasks.jsonl"), "model": str(run.model_dir), "output_dir": str(run.output_dir),
        "store": str(run.store), "reward": "events", "agents": ["writer"], "group_size": 2, "tasks_per_step": 2,
        "steps": steps, "val_tasks": str(root / "val.jsonl"), "val_every": 2, "val_attempts": 2,
        "checkpoint_every": 0, "policy_port": 0, "bridge_port": bridge_port, "device": TEST_DEVICE,
        "rollout_timeout_s": 300, "seed": 0,
    }))  # JSON is YAML
    try:
        receiver = run.start("receiver", "receive", "--db", str(run.store), "--grpc-port", str(grpc_port),
                             "--http-port", "0", "--grace-s", "0.2", "--poll-s", "0.05", "--air-rules", "default")
        wait_for_text(run.log("receiver"), "spanrl receive: ready", receiver, 60)
        run.start("train", "train", str(root / "train.yaml"))
        run.start("runner", "run", "--agent", "two_agents:solve", "--python-path", str(AGENTS),
                  "--bridge-url", f"http://127.0.0.1:{bridge_port}", "--otlp-endpoint", f"http://127.0.0.1:{grpc_port}",
                  "--concurrency", "4",
                  env={"DASHBOARD_TEST_GATE": str(run.gate), "DASHBOARD_TEST_GATE_STEP": str(gate_step)})
        run.wait_steps(gate_step - 1, timeout_s=400)
        port = free_port()
        dashboard = run.start("dashboard", "dashboard", "--store", str(run.store), "--output-dir",
                              str(run.output_dir), "--tokenizer", str(run.model_dir), "--port", str(port),
                              "--refresh-s", "0.5")
        wait_for_text(run.log("dashboard"), "spanrl dashboard: ready", dashboard, 60)
        run.dashboard_url = f"http://127.0.0.1:{port}"
    except BaseException:
        run.stop()
        raise
    return run
