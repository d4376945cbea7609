"""What the APO tests share (the torch backend's here, the verl backend's in tests/verl_backend): the
reply-format model, the ``spanrl`` commands as child processes, and which prompt candidate the
endpoint's spans say each rollout was served."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from spanrl.examples.reply_format.demonstrations import write_demonstrations

TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT = "spanrl.examples.reply_format.agent:reply"
REWARD = "spanrl.examples.reply_format.reward:reward"
BRACKETS = "Reply with the word in square brackets."
KEY = "sk-apo-test-4f1d0c9e7b2a"  # the optimizer's key: must never be logged or stored


def format_model(root) -> str:
    """A tiny model that follows the format its instructions name (~40 s of SFT on one core); the
    module's tests share it (``model``)."""
    import torch

    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
    from spanrl.trainer_bridge.warm_start import WarmStartConfig, warm_start_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    demonstrations = write_demonstrations(str(root / "demonstrations.jsonl"), 2000, seed=0)
    base = create_model_dir(root / "model-init", preset="tiny", corpus_files=[demonstrations], seed=0)
    warm_start_model(WarmStartConfig(demonstrations=demonstrations, steps=300, batch_size=32, learning_rate=2e-3,
                                     device=TEST_DEVICE), str(base), str(root / "model"), progress=False)
    torch.set_num_threads(threads)
    return str(root / "model")


def wait_for_text(path, text: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        assert process.poll() is None, f"exited {process.returncode} before {text!r}:\n{path.read_text()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not said within {timeout_s} s")


def served_candidates(db: str) -> dict[str, set[str]]:
    """rollout id -> the prompt candidates the endpoint's spans say its calls were served."""
    from spanrl.instrumentation import semconv
    from spanrl.otlp_receiver.span_tree import records_from_bodies
    from spanrl.otlp_receiver.store import SpanStore

    store = SpanStore(db)
    served: dict[str, set[str]] = {}
    for rollout_id in store.iter_rollout_ids():
        for record in records_from_bodies(span.body for span in store.rollout_spans(rollout_id)):
            candidate = record.attributes.get(semconv.PROMPT_CANDIDATE)
            if candidate is not None:
                served.setdefault(rollout_id, set()).add(candidate)
    store.close()
    return served


TOLD = (" WARNING ", " ERROR ", "runner finished", "Traceback")  # lines of a process's log a failure shows


def run_story(logs: dict) -> str:
    """What a failed APO test's message should show: each process's ``apo`` lines, warnings and
    errors (a rollout that failed, timed out or was lost says why) and the runner's counts."""
    told = []
    for name, path in logs.items():
        if path.exists():
            told += [f"{name}: {line}" for line in path.read_text().splitlines()
                     if line.startswith(("apo", "rollouts:")) or any(mark in line for mark in TOLD)]
    return "\n".join(told[-60:])


class SpanrlProcesses:
    """``spanrl`` commands started as child processes of a test, each logging to ``<name>.log``
    in ``folder``, with no OTLP or spanrl variable of this environment; ``stop_all`` stops them."""

    def __init__(self, folder):
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_SPANRL_", "OTEL_EXPORTER_"))},
                    "PYTHONUNBUFFERED": "1"}
        self.folder = folder
        self.logs: dict = {}
        self.processes: list[subprocess.Popen] = []

    def start(self, name: str, *argv: str, env: dict | None = None) -> subprocess.Popen:
        self.logs[name] = self.folder / f"{name}.log"
        with open(self.logs[name], "w") as log:
            process = subprocess.Popen([sys.executable, "-m", "spanrl", *argv], stdout=log, stderr=subprocess.STDOUT,
                                       env={**self.env, **(env or {})}, cwd=REPO)
        self.processes.append(process)
        return process

    def stop_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                process.wait(30)
