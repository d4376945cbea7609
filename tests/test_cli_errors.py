"""Every CLI failure a user can cause is one line naming the fix, exit 2, no traceback.

Each test runs the real ``python -m spanrl`` in a subprocess against real files, sockets and
receivers: a missing or non-model directory, a taken port (receiver, policy server, task API,
also one held by another receiver), an unreadable or invalid YAML config, a store another
receiver writes, no receiver (or bridge) at start; and a reader that closes the pipe early.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from spanrl.child_processes import free_port
from spanrl.demo import CALC_AGENT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spanrl(*argv: str, cwd: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``spanrl`` logging warnings only (info lines go to stderr too: only the error is left)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_SPANRL_")}
    return subprocess.run([sys.executable, "-m", "spanrl", "--log-level", "WARNING", *argv], capture_output=True,
                          text=True, timeout=timeout, env=clean, cwd=cwd or REPO)


def one_line_error(result: subprocess.CompletedProcess, command: str) -> str:
    """The single stderr line of a user error (exit 2), without the ``spanrl <command>: `` prefix."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    prefix = f"spanrl {command}: "
    assert lines[0].startswith(prefix), lines[0]
    return lines[0][len(prefix):]


@pytest.fixture
def fake_model(tmp_path):
    """A folder that passes the model check (config.json): the errors below come before any load."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def train_config(tmp_path, model, **more) -> str:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "a", "question": "1+1", "answer": 2}) + "\n")
    config = tmp_path / "train.yaml"
    values = {"tasks": str(tasks), "model": str(model), "output_dir": str(tmp_path / "run"),
              "store": str(tmp_path / "spanrl.db"), "device": "cpu", "bridge_port": free_port(),
              "policy_port": free_port(), **more}
    config.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in values.items()))
    return str(config)


def start_receiver(db, grpc_port: int = 0) -> tuple[subprocess.Popen, int]:
    """A real ``spanrl receive`` on ``db``; returns it once ready, with its gRPC port."""
    process = subprocess.Popen(
        [sys.executable, "-m", "spanrl", "receive", "--db", str(db), "--grpc-port", str(grpc_port),
         "--http-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("spanrl receive: ready"):
            return process, int(line.split("OTLP/gRPC 127.0.0.1:")[1].split(",")[0])
    process.wait(10)
    raise AssertionError("the receiver did not start")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# --- the model directory ---------------------------------------------------------------------

def test_serve_on_a_missing_model_directory(tmp_path):
    missing = tmp_path / "no-such-model"
    message = one_line_error(spanrl("serve", str(missing)), "serve")
    assert message == (f"model_dir '{missing}': no such directory; create one with `spanrl model init {missing}` "
                       "(random weights) or give a Hugging Face model folder")


def test_serve_on_a_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    message = one_line_error(spanrl("serve", str(tmp_path)), "serve")
    assert message.startswith(f"model_dir '{tmp_path}' is not a Hugging Face model directory (no config.json); "
                              f"create one with `spanrl model init {tmp_path}`")


def test_train_on_a_missing_model_directory(tmp_path):
    missing = tmp_path / "no-such-model"
    message = one_line_error(spanrl("train", train_config(tmp_path, missing)), "train")
    assert message.startswith(f"model '{missing}': no such directory; create one with `spanrl model init")


def test_demo_on_a_folder_that_is_not_a_model(tmp_path):
    message = one_line_error(spanrl("demo", "--model", str(tmp_path), "--output-dir", str(tmp_path / "out")), "demo")
    assert message.startswith(f"--model '{tmp_path}': not a model folder (no config.json there)"), message
    assert not (tmp_path / "out" / "model-init").exists()  # refused before creating anything


# --- ports -----------------------------------------------------------------------------------

@pytest.mark.parametrize("setting, says", [
    ("bridge_port", "the task API for runners cannot listen on"),
    ("policy_port", "the policy server cannot listen on"),
])
def test_train_on_a_taken_port(tmp_path, fake_model, setting, says):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = spanrl("train", train_config(tmp_path, fake_model, **{setting: port}))
    message = one_line_error(result, "train")
    flag = "--" + setting.replace("_", "-")
    assert message == (f"{says} 127.0.0.1:{port} ({setting}): Address already in use (another spanrl process "
                       f"still running? stop what holds it, or choose another port with {flag})")
    assert time.monotonic() - started < 60  # said before any model loads


def test_a_second_receiver_on_the_same_grpc_port_is_refused(tmp_path):
    """grpcio shares ports by default (SO_REUSEPORT): a second receiver would start and take
    half of the spans. It must stop, naming the port."""
    first, grpc_port = start_receiver(tmp_path / "first.db")
    try:
        result = spanrl("receive", "--db", str(tmp_path / "second.db"), "--grpc-port", str(grpc_port),
                        "--http-port", "0", timeout=60)
    finally:
        stop(first)
    message = one_line_error(result, "receive")
    assert message.startswith(f"cannot start the receiver: cannot bind OTLP/gRPC on 127.0.0.1:{grpc_port} "
                              "(grpc_port): Address already in use")
    assert message.endswith("with --grpc-port)")


# --- the config file -------------------------------------------------------------------------

def test_invalid_yaml_is_one_line_with_its_position(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("tasks: tasks.jsonl\nmodel: [unclosed\n")
    message = one_line_error(spanrl("train", str(config)), "train")
    assert message.startswith(f"config file {config} is not valid YAML (line 3, column 1): ")
    assert message.endswith("fix the file (YAML: `key: value` a line, lists as [a, b])")


def test_an_unreadable_config_is_one_line(tmp_path):
    message = one_line_error(spanrl("run", str(tmp_path)), "run")  # a folder, not a file
    assert message == f"cannot read config file {tmp_path}: [Errno 21] Is a directory: '{tmp_path}'"


# --- the store and the receiver --------------------------------------------------------------

def test_a_store_another_receiver_writes_is_refused(tmp_path):
    db = tmp_path / "spanrl.db"
    first, _ = start_receiver(db)
    try:
        result = spanrl("receive", "--db", str(db), "--grpc-port", "0", "--http-port", "0", timeout=60)
    finally:
        stop(first)
    message = one_line_error(result, "receive")
    assert message == (f"cannot start the receiver: the span store {db} is in use by another receiver "
                       f"(process {first.pid}); stop that receiver, or give this one another store with --db")
    # once the first one stopped, the store is free again
    again, _ = start_receiver(db)
    stop(again)
    assert again.returncode == 0


def test_train_without_a_receiver_on_its_store(tmp_path, fake_model):
    store = tmp_path / "spanrl.db"
    result = spanrl("train", train_config(tmp_path, fake_model), "--receiver-wait-s", "0.5")
    message = one_line_error(result, "train")
    assert message == (f"no `spanrl receive` is writing the store '{store}' (waited 0 s); start "
                       f"`spanrl receive --db {store}`, or set store: to the --db of the running one")


def test_run_without_a_receiver(tmp_path):
    endpoint = f"http://127.0.0.1:{free_port()}"
    result = spanrl("run", "--agent", CALC_AGENT, "--otlp-endpoint", endpoint, "--bridge-wait-s", "1")
    message = one_line_error(result, "run")
    assert message == (f"cannot reach the receiver (otlp_endpoint) at {endpoint} (Connection refused) after 1 s: "
                       "start `spanrl receive` first, or point --otlp-endpoint at its OTLP/gRPC port")


def test_run_without_a_bridge(tmp_path):
    receiver, grpc_port = start_receiver(tmp_path / "spanrl.db")
    bridge = f"http://127.0.0.1:{free_port()}"
    try:
        result = spanrl("run", "--agent", CALC_AGENT, "--otlp-endpoint", f"http://127.0.0.1:{grpc_port}",
                        "--bridge-url", bridge, "--bridge-wait-s", "1")
    finally:
        stop(receiver)
    message = one_line_error(result, "run")
    assert message.startswith(f"cannot reach the bridge at {bridge}: [Errno 111] Connection refused; ")
    assert message.endswith("start `spanrl train` first, or point --bridge-url at its task API "
                            "(the URL `spanrl train` prints)")


def test_inspect_of_an_unknown_rollout(tmp_path):
    from spanrl.otlp_receiver.store import SpanStore

    db = tmp_path / "spanrl.db"
    SpanStore(db).close()
    message = one_line_error(spanrl("inspect", "rollout", "nope", "--db", str(db)), "inspect")
    assert message == f"no rollout 'nope' in the store {db}; `spanrl inspect rollouts` lists them"


# --- a reader that leaves early --------------------------------------------------------------

def test_inspect_piped_into_head_ends_quietly(tmp_path):
    """``spanrl inspect transitions --json | head -1``: no BrokenPipeError traceback."""
    from spanrl.otlp_receiver.store import SpanStore
    from spanrl.schema.rollouts import AssembledRollout, Transition

    db = tmp_path / "spanrl.db"
    with SpanStore(db) as store:
        for number in range(20):
            rollout_id = f"r{number}"
            transitions = tuple(
                Transition(rollout_id, i, f"span{i}", "solver", tuple(range(500)), tuple(range(500)), None, 0, 0,
                           0.0, 1.0, False)
                for i in range(4))
            store.save_assembled(AssembledRollout(rollout_id, "t", 0, "ok", None, "explicit", 1.0, (), {},
                                                  transitions, (), 0))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_SPANRL_")}
    process = subprocess.Popen([sys.executable, "-m", "spanrl", "inspect", "transitions", "--json", "--db", str(db)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean, cwd=REPO)
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline().strip() == b"["  # the reader takes one line and leaves
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(60) == 141  # 128 + SIGPIPE, as a shell reports a program ended by the pipe
    assert stderr == ""
