"""What the proxy tests share: a real ``spanrl receive`` process, waiting for its rollouts, a
tool-calling teacher model, and an upstream that accepts connections and never answers."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from spanrl.child_processes import free_port, wait_for_port
from spanrl.otlp_receiver.store import SpanStore
from spanrl.schema.rollouts import AssembledRollout

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FORCED = {"type": "function", "function": {"name": "get_weather"}}
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Kyiv", "Doha"]


def weather_demo(city: str, degrees: int) -> dict:
    return {"tools": [WEATHER], "messages": [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": f"{degrees} C"},
        {"role": "assistant", "content": f"It is {degrees} C in {city}."}]}


def make_teacher(folder: Path, device: str) -> Path:
    """A tiny model warm-started on tool-calling demonstrations: forced to call ``get_weather``,
    it writes valid arguments, and it answers a tool result in a sentence."""
    import torch

    from spanrl.trainer_bridge.torch_backend import sft
    from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

    corpus = folder / "demonstrations.jsonl"
    corpus.write_text("".join(json.dumps(weather_demo(city, n)) + "\n" for n, city in enumerate(CITIES * 5)))
    model_dir = create_model_dir(folder / "init", preset="tiny", corpus_files=[corpus], seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = TorchTrainer(str(model_dir), TrainerConfig(device=device, seed=0))
        examples = sft.load_chat_jsonl(corpus)[:1]  # Paris
        stats = sft.sft_on_examples(trainer, examples, 150, batch_size=1, lr=5e-3, progress=False)
        assert stats["loss_last"] < 0.05, stats
        trainer.save_checkpoint(str(folder / "teacher"))
    finally:
        torch.set_num_threads(threads)
    return folder / "teacher"


@contextlib.contextmanager
def running_receiver(folder: Path) -> Iterator[dict]:
    """``spanrl receive`` on free ports, its store in ``folder``: {"db", "grpc", "http"}."""
    db = folder / "spanrl.db"
    grpc_port, http_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "spanrl", "receive", "--db", str(db), "--grpc-port", str(grpc_port),
         "--http-port", str(http_port), "--grace-s", "2"],  # the default: endpoints export spans each 0.5 s
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_port(grpc_port, process, "spanrl receive")
        wait_for_port(http_port, process, "spanrl receive")
        yield {"db": db, "grpc": f"http://127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{http_port}"}
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        process.communicate()


def complete(receiver: dict, rollout_id: str) -> None:
    """End a rollout explicitly, as a runner does for an agent without a rollout span."""
    request = urllib.request.Request(f"{receiver['http']}/spanrl/v1/rollouts/{rollout_id}/complete", data=b"",
                                     method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status in (200, 202)


def assembled(receiver: dict, rollout_id: str, timeout_s: float = 30.0) -> AssembledRollout:
    with SpanStore(receiver["db"]) as store:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = store.assembled_rollout(rollout_id)
            if found is not None:
                return found
            time.sleep(0.1)
    raise AssertionError(f"rollout {rollout_id} was not assembled within {timeout_s} s")


def span_bodies(receiver: dict, rollout_id: str) -> list[bytes]:
    with SpanStore(receiver["db"]) as store:
        return [span.body for span in store.rollout_spans(rollout_id)]


@contextlib.contextmanager
def silent_upstream() -> Iterator[str]:
    """A loopback port that accepts connections and never answers: its URL."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        yield f"http://127.0.0.1:{silent.getsockname()[1]}/v1"
    finally:
        silent.close()


def wait_for_line(process: subprocess.Popen, text: str, timeout_s: float = 60.0) -> str:
    """The output of ``process`` (stdout, text mode) up to the line holding ``text``."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline() if process.stdout is not None else ""
        if not line and process.poll() is not None:
            break
        lines.append(line)
        if text in line:
            return "".join(lines)
    raise AssertionError(f"no line with {text!r} (exit status {process.poll()}):\n{''.join(lines)}")


def unused_port_url() -> str:
    """The base URL of a loopback port nothing listens on."""
    return f"http://127.0.0.1:{free_port()}/v1"
